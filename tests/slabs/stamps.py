"""Stamping blocks in the arena's bytes: the multi-process tests' proof that no block was
handed to two runtimes at once (each writes its mark into the first and last byte of every
block it holds and checks both before freeing it)."""

from __future__ import annotations

import numpy as np


def stamp(data: np.ndarray, blocks: np.ndarray, stride: int, mark: int) -> None:
    data[blocks * stride] = mark
    data[blocks * stride + stride - 1] = mark


def check_stamps(data: np.ndarray, blocks: np.ndarray, stride: int, mark: int) -> None:
    firsts, lasts = data[blocks * stride], data[blocks * stride + stride - 1]
    assert (firsts == mark).all() and (lasts == mark).all(), "another runtime wrote here"

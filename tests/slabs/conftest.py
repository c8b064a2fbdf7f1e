"""Fixtures for the slab tests: a small CPU arena in a private folder, and tiny formats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from slab_constants import NUM_SLABS, SLAB_BYTES

from fineslab.slabs.arena import ArenaSpec, SlabArena


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[SlabArena]:
    spec = ArenaSpec("test", "cpu0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8, max_runtimes=8)
    with SlabArena.create(spec, shm_dir=tmp_path) as created:
        yield created

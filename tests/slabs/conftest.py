"""Fixtures for the slab tests: a small CPU arena in a private folder, and tiny formats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape

#: Two formats whose block strides divide an 8-block slab of A: A = 512 B, B = 1,024 B.
FMT_A = BlockFormat.unpadded(KVShape("a", 2, 2, 8, KVDtype.BF16), 4)
FMT_B = BlockFormat(KVShape("b", 2, 2, 8, KVDtype.INT4), 4, 256)
SLAB_BYTES = 8 * FMT_A.block_stride_bytes
NUM_SLABS = 6


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[SlabArena]:
    spec = ArenaSpec("test", "cpu0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8, max_runtimes=8)
    with SlabArena.create(spec, shm_dir=tmp_path) as created:
        yield created

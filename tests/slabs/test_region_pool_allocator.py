"""The C allocator behind `region_pool` (cuda_pool.py), called directly on CPU: first fit inside
the region, freed gaps reused, the high-water mark, and a region too small refusing (NULL)."""

from __future__ import annotations

import ctypes

import pytest

from fineslab.slabs.cuda_pool import _library

BASE, SPAN = 1 << 40, 64 << 20  # addresses only: nothing is dereferenced


@pytest.fixture
def pool() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_library()))
    lib.fineslab_pool_set.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
    lib.fineslab_pool_alloc.argtypes = (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    lib.fineslab_pool_alloc.restype = ctypes.c_size_t
    lib.fineslab_pool_free.argtypes = (ctypes.c_size_t, ctypes.c_ssize_t, ctypes.c_int,
                                       ctypes.c_void_p)
    lib.fineslab_pool_high.restype = ctypes.c_size_t
    lib.fineslab_pool_live.restype = ctypes.c_size_t
    lib.fineslab_pool_set(BASE, SPAN)
    return lib


def test_segments_are_placed_first_fit_and_freed_gaps_are_reused(pool: ctypes.CDLL) -> None:
    mib = 1 << 20
    a, b, c = (pool.fineslab_pool_alloc(n * mib, 0, None) for n in (2, 20, 2))
    assert (a, b, c) == (BASE, BASE + 2 * mib, BASE + 22 * mib), "packed from the base"
    assert pool.fineslab_pool_high() == 24 * mib
    pool.fineslab_pool_free(b, 20 * mib, 0, None)
    assert pool.fineslab_pool_alloc(4 * mib, 0, None) == BASE + 2 * mib, "the first gap that fits"
    assert pool.fineslab_pool_alloc(30 * mib, 0, None) == BASE + 24 * mib, "after the last one"
    assert pool.fineslab_pool_high() == 54 * mib
    assert pool.fineslab_pool_live() == 4


def test_a_request_beyond_the_region_gets_null(pool: ctypes.CDLL) -> None:
    assert pool.fineslab_pool_alloc(SPAN - 512, 0, None) == BASE
    assert pool.fineslab_pool_alloc(1024, 0, None) == 0, "full: CUDA's out-of-memory path"
    pool.fineslab_pool_free(BASE, SPAN - 512, 0, None)
    assert pool.fineslab_pool_live() == 0
    assert pool.fineslab_pool_alloc(1024, 0, None) == BASE, "room again once freed"

"""Key pools (PooledSlabs): runtimes of one block stride share their key's slabs.

Slab layout in these tests (FMT_A: 8 blocks a slab, NUM_SLABS = 6):

    slab 0: [a a a b b . . .]   a and b are two pooled runtimes of FMT_A
    slab 1: ...

Every test checks the table's invariants (T1-T6) after each mutation. The runtimes here
have no block cache, so that placement is exact; test_slab_pool_cache.py covers the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
from slab_constants import FMT_A, FMT_B, NUM_SLABS, dead_pid

from fineslab.errors import ArenaExhausted, IntegrityError, InvalidBlockError
from fineslab.slabs.arena import SlabArena
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.pooled import PooledSlabs
from fineslab.slabs.table import POOLED, SlabState


def _pair(arena: SlabArena) -> tuple[PooledSlabs, PooledSlabs]:
    """Two pooled runtimes without block caches: every block placed by the pool's rules (the
    cache, on by default, is test_slab_pool_cache.py's)."""
    return (PooledSlabs(arena.table, "a", FMT_A, cache_blocks=0),
            PooledSlabs(arena.table, "b", FMT_A, cache_blocks=0))


def test_two_runtimes_share_one_slab(arena: SlabArena) -> None:
    a, b = _pair(arena)
    assert a.alloc(3) == [0, 1, 2]
    assert b.alloc(2) == [3, 4], "b takes the free blocks of the slab a carved"
    check_integrity(arena.table)
    t = arena.table
    assert t.owner[0] == POOLED and t.used[0] == 5 and t.state[1] == SlabState.FREE
    assert t.block_owner[0, :6].tolist() == [a.mark] * 3 + [b.mark] * 2 + [0]
    assert a.num_used_blocks() == 3 and b.num_used_blocks() == 2
    assert a.num_free_blocks() == b.num_free_blocks() == 3, "the pool's free blocks"
    assert a.available_blocks() == 3 + (NUM_SLABS - 1) * 8


def test_both_block_sources_say_whether_the_padding_slab_is_free(arena: SlabArena) -> None:
    """SlabAllocator asks its source (pooled or not) whether slab 0 is free, to leave it out of
    its room; the pooled source once lacked the call and every pooled runtime died."""
    a, _ = _pair(arena)
    private = arena.client("p", FMT_B)
    assert a.padding_slab_free() and private.padding_slab_free()
    held = a.alloc(1)
    assert held == [0] and not a.padding_slab_free() and not private.padding_slab_free()
    a.free(held)
    assert a.padding_slab_free()
    private.close()


def test_blocks_a_runtime_frees_are_reused_by_the_other(arena: SlabArena) -> None:
    a, b = _pair(arena)
    held = a.alloc(8)
    b.alloc(1)  # slab 1
    a.free(held[2:6])
    check_integrity(arena.table)
    assert b.alloc(4) == [2, 3, 4, 5], "holes in slab 0 serve b before slab 1's rest"
    check_integrity(arena.table)
    assert snapshot(arena.table).free_slabs == NUM_SLABS - 2


def test_a_pool_slab_returns_to_free_space_when_its_last_block_goes(arena: SlabArena) -> None:
    a, b = _pair(arena)
    mine, theirs = a.alloc(2), b.alloc(1)
    a.free(mine)
    assert arena.table.state[0] == SlabState.PARTIAL, "b still holds a block there"
    b.free(theirs)
    check_integrity(arena.table)
    assert arena.table.state[0] == SlabState.FREE and arena.table.owner[0] == -1
    assert not arena.table.block_owner.any()


def test_pool_and_private_runtimes_keep_apart(arena: SlabArena) -> None:
    a, _ = _pair(arena)
    private_a = arena.client("private-a", FMT_A)
    other_key = arena.client("pooled-b", FMT_B, pooled=True)
    a.alloc(1)
    assert private_a.alloc(1) == [8], "a private runtime of the same key carves its own slab"
    assert other_key.alloc(1) == [8], "another key's pool gets its own slabs (slab 2, bps 4)"
    check_integrity(arena.table)
    assert arena.table.key[2] == FMT_B.block_stride_bytes and arena.table.owner[2] == POOLED


def test_prefill_of_a_slab_or_more_takes_whole_fresh_slabs(arena: SlabArena) -> None:
    a, b = _pair(arena)
    b.alloc(1)
    ids = a.alloc(10)
    check_integrity(arena.table)
    assert ids[:8] == list(range(8, 16)), "the whole-slab part in a fresh slab (slab 1)"
    assert ids[8:] == [1, 2], "the rest from the pool's lowest partial slab"


def test_near_hint_fills_the_requests_slab_first(arena: SlabArena) -> None:
    a, b = _pair(arena)
    a.alloc(8)
    tail = b.alloc(2)  # slab 1
    a.free([0])
    assert b.alloc(1, near_block=tail[-1]) == [10], "the hint's slab before slab 0's hole"
    assert b.alloc(1, near_block=999) == [0], "a stale hint is ignored"
    check_integrity(arena.table)


def test_exhaustion_raises_and_changes_nothing(arena: SlabArena) -> None:
    a, b = _pair(arena)
    a.alloc(5)
    before, squeeze = arena.table.raw(), arena.table.pool_squeeze
    with pytest.raises(ArenaExhausted):
        b.alloc(NUM_SLABS * 8 - 5 + 1)
    assert arena.table.pool_squeeze == squeeze + 1, "a short pool asks for the caches back"
    arena.table.header[13] = squeeze  # the squeeze counter (table._Hdr.POOL_SQUEEZE)
    assert arena.table.raw() == before, "nothing else changed"
    assert len(b.alloc(NUM_SLABS * 8 - 5)) == NUM_SLABS * 8 - 5, "exactly the rest fits"
    check_integrity(arena.table)


@pytest.mark.parametrize("case", ["foreign", "double", "repeat", "range", "private"])
def test_bad_free_raises_and_changes_nothing(arena: SlabArena, case: str) -> None:
    a, b = _pair(arena)
    mine, theirs = a.alloc(3), b.alloc(2)
    a.free([mine[0]])
    private = arena.client("private", FMT_A).alloc(1)
    bad, message = {
        "foreign": ([theirs[0]], "another runtime's"),
        "double": ([mine[0]], "already free"),
        "repeat": ([mine[1], mine[1]], "repeats"),
        "range": ([NUM_SLABS * 8], "out of range"),
        "private": (private, "not in its key pool"),
    }[case]
    before = arena.table.raw()
    with pytest.raises(InvalidBlockError, match=message):
        a.free(bad)
    assert arena.table.raw() == before, "a refused free changes nothing"


def test_close_frees_only_the_closing_runtimes_blocks(arena: SlabArena) -> None:
    a, b = _pair(arena)
    a.alloc(12)
    theirs = b.alloc(3)
    a.close()
    check_integrity(arena.table)
    assert arena.table.used[:2].tolist() == [0, 3], "slab 0 was all a's; b's 3 stay in slab 1"
    assert b.num_used_blocks() == 3 and snapshot(arena.table).free_slabs == NUM_SLABS - 1
    b.free(theirs)
    assert snapshot(arena.table).free_slabs == NUM_SLABS


def test_a_dead_pooled_runtime_is_reclaimed_block_by_block(arena: SlabArena) -> None:
    a, b = _pair(arena)
    a.alloc(5)
    kept = b.alloc(2)
    arena.table.rt_pid[a.slot] = dead_pid()
    assert arena.table.reclaim_dead_owners() == ["a"]
    check_integrity(arena.table)
    assert arena.table.used[0] == 2 and arena.table.block_owner[0, 5:7].tolist() == [b.mark] * 2
    b.free(kept)
    assert snapshot(arena.table).free_slabs == NUM_SLABS


def test_the_dead_owner_log_counts_its_key_pool_blocks(
        arena: SlabArena, caplog: pytest.LogCaptureFixture) -> None:
    # Issue #15, defect 11: the log said `reclaiming 0 slab(s)` when 12 blocks came back.
    a, _ = _pair(arena)
    a.alloc(5)
    arena.table.rt_pid[a.slot] = dead_pid()
    with caplog.at_level("WARNING", logger="fineslab.slabs.table"):
        arena.table.reclaim_dead_owners()
    assert "its 0 own slab(s) and 5 block(s) in its key pool" in caplog.text, caplog.text


def test_lock_holder_death_mid_pool_update_is_repaired(arena: SlabArena) -> None:
    a, b = _pair(arena)
    a.alloc(3)
    b.alloc(2)
    t = arena.table
    t.block_owner[0, 5] = a.mark  # an alloc cut short: owner written, free map and count not
    t.header[8] = dead_pid()  # the holder died inside the lock
    check_integrity(t)  # takes the lock, which repairs first
    assert t.used[0] == 6 and t.free_map[0, 5] == 0


@pytest.mark.parametrize("rule", ["beyond", "free-map", "inactive", "private-row"])
def test_check_integrity_catches_each_broken_pool_invariant(arena: SlabArena, rule: str
                                                           ) -> None:
    a, b = _pair(arena)
    a.alloc(3)
    b.alloc(1)
    private = arena.client("private", FMT_A)
    private.alloc(1)  # slab 1
    t = arena.table
    if rule == "beyond":
        pooled_b = arena.client("pooled-b", FMT_B, pooled=True)
        pooled_b.alloc(1)  # slab 2, 4 blocks a slab
        t.block_owner[2, 5] = pooled_b.mark
    elif rule == "free-map":
        t.free_map[0, 1] = 1
    elif rule == "inactive":
        t.block_owner[0, 0] = 8  # slot 7: no runtime
    elif rule == "private-row":
        t.block_owner[1, 0] = private.slot + 1
    with pytest.raises(IntegrityError, match="T6"):
        check_integrity(t)


def test_snapshot_reports_pool_usage_per_runtime(arena: SlabArena) -> None:
    a, b = _pair(arena)
    a.alloc(10)
    b.alloc(2)
    usage = {o.runtime_id: o for o in snapshot(arena.table).owners}
    assert usage["a"].pooled and usage["a"].used_blocks == 10 and usage["a"].num_slabs == 2
    assert usage["b"].used_blocks == 2 and usage["b"].num_slabs == 1
    assert usage["a"].free_blocks == usage["b"].free_blocks == 4, "the pool's free blocks"
    stats = b.stats()
    assert stats.used_blocks == 2 and stats.free_blocks == 4 and stats.free_slabs == 4




def test_alloc_array_is_int64_and_empty_for_zero(arena: SlabArena) -> None:
    a, _ = _pair(arena)
    assert a.alloc_array(0).dtype == np.int64 and a.alloc_array(0).size == 0
    assert a.alloc_array(2).dtype == np.int64
    with pytest.raises(InvalidBlockError):
        a.alloc_array(-1)

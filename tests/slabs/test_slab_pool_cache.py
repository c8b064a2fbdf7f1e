"""The key pool's block cache (pool_cache.py, PooledSlabs): blocks moved in batches under one
lock acquisition, served and taken back without the lock.

FMT_A: 8 blocks a slab, so a cache holds at most 8 blocks and a refill or a spill leaves 4.

    after a.alloc(1):  slab 0: [A c c c c . . .]   A: handed out, c: a's cache (both marked a's)

Every test checks the table's invariants (T1-T7) and the runtimes' own after each mutation; the
cross-process tests use real processes on one shared table and arena file.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from slab_constants import FMT_A, FMT_B, NUM_SLABS, SLAB_BYTES
from stamps import check_stamps, stamp

from fineslab.errors import ArenaExhausted, ConfigError, InvalidBlockError
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.pool_cache import BlockCache
from fineslab.slabs.pooled import PooledSlabs
from fineslab.slabs.table import SlabState

_CTX = mp.get_context("spawn")
TOTAL = NUM_SLABS * 8


def _check(*runtimes: PooledSlabs) -> None:
    for rt in runtimes:
        rt.check_integrity()


def _used_by(arena: SlabArena, runtime_id: str) -> int:
    return {o.runtime_id: o for o in snapshot(arena.table).owners}[runtime_id].used_blocks


def test_block_cache_pops_the_top_and_spills_the_highest_ids() -> None:
    cache = BlockCache(8, 100)
    assert cache.put(np.array([5, 9, 2])) and cache.size == 3
    assert cache.take(1).tolist() == [2], "the block pushed last comes out first"
    assert not cache.put(np.arange(20, 27)), "9 blocks do not fit 8"
    assert cache.size == 2 and cache.holds_any(np.array([9])), "a refused put changes nothing"
    give = cache.spill(np.array([50, 1, 40, 3]))
    assert give.tolist() == [40, 50], "all but the 4 lowest go back, ascending"
    assert cache.take(1).tolist() == [1], "the lowest kept is handed out first"
    assert not cache.holds_any(np.array([1, 40, 50]))
    cache.check()
    assert cache.drain().tolist() == [3, 5, 9] and cache.size == 0
    cache.check()


def test_a_cache_beyond_one_slab_is_refused(arena: SlabArena) -> None:
    with pytest.raises(ConfigError, match="one slab"):
        PooledSlabs(arena.table, "a", FMT_A, cache_blocks=9)
    assert arena.table.active_runtimes() == {}, "a refused runtime is not registered"


def test_an_allocation_refills_the_cache_and_the_next_ones_take_no_lock(
        arena: SlabArena) -> None:
    a = PooledSlabs(arena.table, "a", FMT_A)
    assert a.alloc(1) == [0] and a.num_locked_calls == 1
    _check(a)
    t = arena.table
    assert t.used[0] == 5 and t.block_owner[0, :6].tolist() == [a.mark] * 5 + [0]
    assert a.num_used_blocks() == 1 and a.num_cached_blocks() == 4
    assert _used_by(arena, "a") == 5, "neighbours see cached blocks as a's, used"
    before = t.raw()
    assert [a.alloc(1)[0] for _ in range(4)] == [1, 2, 3, 4], "lowest first, from the cache"
    assert a.num_locked_calls == 1 and t.raw() == before, "no lock, no table write"
    _check(a)
    assert a.alloc(2) == [5, 6] and a.num_locked_calls == 2, "an empty cache takes the lock"
    _check(a)


def test_frees_fill_the_cache_then_the_highest_go_back_to_the_pool(arena: SlabArena) -> None:
    a = PooledSlabs(arena.table, "a", FMT_A)
    first = a.alloc(7)  # slab 0: 7 handed out, block 7 cached (the slab's spare)
    assert first == list(range(7)) and a.num_cached_blocks() == 1
    second = a.alloc(7)  # block 7 from the cache, 8-13 from slab 1, 14-15 cached
    assert sorted(second) == list(range(7, 14)) and a.num_cached_blocks() == 2
    _check(a)
    locked = a.num_locked_calls
    a.free(second[:3])  # 2 + 3 <= 8: into the cache
    assert a.num_locked_calls == locked and a.num_cached_blocks() == 5
    _check(a)
    a.free(first)  # 5 + 7 > 8: spill, keep the 4 lowest of all
    assert a.num_locked_calls == locked + 1 and a.num_cached_blocks() == 4
    _check(a)
    t = arena.table
    assert t.block_owner[0].tolist() == [a.mark] * 4 + [0] * 4, "blocks 0-3 kept, 4-6 back"
    assert t.used[0] == 4 and t.used[1] == 4 + 0, "slab 1: blocks 11-13 held, 8-10 back"
    assert a.num_used_blocks() == 4
    a.free(second[3:])
    _check(a)
    assert a.num_used_blocks() == 0 and a.release_cache() > 0
    assert (t.state == SlabState.FREE).all(), "with nothing held every slab is FREE again"
    _check(a)


def test_freeing_a_cached_block_is_refused_and_changes_nothing(arena: SlabArena) -> None:
    a = PooledSlabs(arena.table, "a", FMT_A)
    b = PooledSlabs(arena.table, "b", FMT_A, cache_blocks=0)
    held = a.alloc(1)
    theirs = b.alloc(1)
    a.free(held)  # into the cache
    before, cached = arena.table.raw(), a.num_cached_blocks()
    for bad, message in (([held[0]], "already free"), ([3], "already free"),
                         (theirs, "another runtime's")):
        with pytest.raises(InvalidBlockError, match=message):
            a.free(bad)
    assert arena.table.raw() == before and a.num_cached_blocks() == cached
    _check(a, b)


def test_a_short_neighbour_gets_the_cache_back_at_the_owners_next_call(
        arena: SlabArena) -> None:
    a = PooledSlabs(arena.table, "a", FMT_A)
    b = PooledSlabs(arena.table, "b", FMT_A, cache_blocks=0)
    mine = a.alloc(1)  # blocks 1-4 cached
    rest = TOTAL - 1
    with pytest.raises(ArenaExhausted):
        b.alloc(rest)  # a's cache hides 4 of them: b comes up short, and says so
    _check(a, b)
    assert a.num_cached_blocks() == 4, "a's cache goes back at a's next call, not before"
    a.free(mine)  # the next call: gives back the whole cache, and keeps nothing
    assert a.num_cached_blocks() == 0 and a.num_used_blocks() == 0
    _check(a, b)
    assert len(b.alloc(rest)) == rest, "b's retry finds every block"
    with pytest.raises(ArenaExhausted):
        a.alloc(2)  # now a is short: the squeeze moves again
    assert len(b.alloc(1)) == 1, "and b, squeezed with no cache, still allocates"
    _check(a, b)


def test_release_cache_gives_an_idle_runtimes_stock_to_its_neighbours(
        arena: SlabArena) -> None:
    """The plugin calls release_cache when SGLang finds the runtime idle (verify_byte_accounting):
    an idle runtime keeps no block a neighbour could use."""
    a = PooledSlabs(arena.table, "a", FMT_A)
    b = PooledSlabs(arena.table, "b", FMT_A, cache_blocks=0)
    a.free(a.alloc(1))  # blocks 0-4 in a's cache: slab 0 stays PARTIAL, marked a's
    assert arena.table.state[0] == SlabState.PARTIAL and a.available_blocks() == TOTAL
    others = b.available_blocks()
    assert others == TOTAL - 5, "b cannot count a's cached blocks"
    assert a.release_cache() == 5 and a.release_cache() == 0
    assert arena.table.state[0] == SlabState.FREE and b.available_blocks() == TOTAL
    assert _used_by(arena, "a") == 0
    _check(a, b)


def test_the_kv_limit_counts_the_cache_and_bounds_its_refill(arena: SlabArena) -> None:
    arena.client("pad", FMT_B).alloc(1)  # slab 0, the padding slab: a limit does not count it
    arena.table.set_kv_limit("a", 3 * FMT_A.block_stride_bytes)
    a = PooledSlabs(arena.table, "a", FMT_A)
    first = a.blocks_per_slab  # slab 1's first block
    assert a.alloc(1) == [first] and a.num_cached_blocks() == 2, "refilled up to the limit only"
    assert a.available_blocks() == 2
    assert sorted(a.alloc(2)) == [first + 1, first + 2]
    with pytest.raises(ArenaExhausted, match="KV limit"):
        a.alloc(1)
    assert arena.table.pool_squeeze == 0, "a runtime at its own limit squeezes nobody"
    _check(a)


def test_close_returns_the_cache_with_the_runtimes_blocks(arena: SlabArena) -> None:
    a = PooledSlabs(arena.table, "a", FMT_A)
    a.alloc(3)
    a.close()
    check_integrity(arena.table)
    assert (arena.table.state == SlabState.FREE).all() and not arena.table.block_owner.any()


def test_seeded_random_ops_with_caches_keep_every_invariant(arena: SlabArena) -> None:
    """Two cached pooled runtimes, one uncached, one private runtime of another key."""
    rng = np.random.default_rng(7)
    runtimes = [PooledSlabs(arena.table, "p0", FMT_A), PooledSlabs(arena.table, "p1", FMT_A),
                PooledSlabs(arena.table, "p2", FMT_A, cache_blocks=0)]
    private = arena.client("q", FMT_B)
    live: list[list[np.ndarray]] = [[], [], []]
    for step in range(1500):
        i = int(rng.integers(3))
        if live[i] and rng.random() < 0.45:
            runtimes[i].free(live[i].pop(int(rng.integers(len(live[i])))))
        elif rng.random() < 0.05:
            runtimes[i].release_cache()
        else:
            with contextlib.suppress(ArenaExhausted):  # the arena is small: it runs full
                live[i].append(runtimes[i].alloc_array(int(rng.choice([1, 1, 1, 2, 5, 9]))))
        if step % 200 == 0:
            with contextlib.suppress(ArenaExhausted):  # the pool may hold every slab
                private.free(private.alloc(3))
        held = np.concatenate([b for blocks in live for b in blocks] or [np.empty(0, np.int64)])
        assert np.unique(held).size == held.size, "no block handed out twice"
        for rt, blocks in zip(runtimes, live, strict=True):
            assert rt.num_used_blocks() == sum(b.size for b in blocks)
            assert _used_by(arena, rt.runtime_id) == rt.num_used_blocks() + \
                rt.num_cached_blocks(), "the table counts cached blocks as used"
        _check(*runtimes)
    for rt, blocks in zip(runtimes, live, strict=True):
        for b in blocks:
            rt.free(b)
        rt.release_cache()
    _check(*runtimes)
    assert (arena.table.state == SlabState.FREE).all()


# -- across processes ------------------------------------------------------------------------
STRESS_SLABS = 12
OPS_PER_WORKER = 20_000


def _cache_worker(shm_dir: str, index: int, start: mp.synchronize.Barrier,
                  queue: mp.Queue) -> None:
    """Decode-like singles, short batches and frees through the cache; every block's first and
    last byte stamped with this worker's mark, checked before its free."""
    rt = PooledSlabs.attach("cache", "cpu0", f"w{index}", FMT_A, shm_dir=Path(shm_dir))
    data = np.memmap(rt.table.path.with_suffix(".arena"), dtype=np.uint8, mode="r+")
    rng = np.random.default_rng(index)
    stride, mark = FMT_A.block_stride_bytes, index + 1
    live: list[np.ndarray] = []
    exhausted = 0
    start.wait()
    for op in range(OPS_PER_WORKER):
        if live and rng.random() < len(live) / (len(live) + 12):
            blocks = live.pop(int(rng.integers(len(live))))
            check_stamps(data, blocks, stride, mark)
            rt.free(blocks)
        else:
            try:
                blocks = rt.alloc_array(1 if rng.random() < 0.8 else int(rng.integers(2, 7)))
            except ArenaExhausted:
                exhausted += 1
                continue
            stamp(data, blocks, stride, mark)
            live.append(blocks)
        if op % 500 == 0:
            rt.check_integrity()
    for blocks in live:
        rt.free(blocks)
    rt.check_integrity()
    queue.put((index, rt.num_locked_calls, exhausted))
    rt.close()


def test_two_processes_allocating_through_their_caches_never_share_a_block(
        tmp_path: Path) -> None:
    """Regression guard for the cache's lock-free path: a block handed out is never handed out
    again, in either process, until it is freed; the stamps would show it."""
    spec = ArenaSpec("cache", "cpu0", STRESS_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        start, queue = _CTX.Barrier(2), _CTX.Queue()
        workers = [_CTX.Process(target=_cache_worker, args=(str(tmp_path), i, start, queue))
                   for i in range(2)]
        for worker in workers:
            worker.start()
        checks = 0
        while any(w.is_alive() for w in workers):
            check_integrity(arena.table, exact_owners=[])
            checks += 1
            time.sleep(0.02)
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0, "each worker finished cleanly, stamps intact"
        results = [queue.get(timeout=5) for _ in workers]
        check_integrity(arena.table)
        assert (arena.table.state == SlabState.FREE).all(), "everything came back on close"
        assert checks > 3, "the table was checked while the workers ran"
        for _, locked, _ in results:
            assert locked < OPS_PER_WORKER // 3, f"the cache served most calls ({locked} locked)"


def _victim(shm_dir: str, ready: mp.synchronize.Event) -> None:
    rt = PooledSlabs.attach("kill", "cpu0", "victim", FMT_A, shm_dir=Path(shm_dir))
    held = rt.alloc(12)  # slab 1 whole; 4 blocks of slab 0, 4 cached
    rt.free(held[:3])  # a full cache of 7 blocks, none handed out
    assert rt.num_cached_blocks() == 7
    ready.set()
    while True:  # churn through the cache, mostly without the lock
        rt.free(rt.alloc(1))


@pytest.mark.parametrize("delay_s", [0.0, 0.1])
def test_a_sigkilled_runtime_leaks_no_cached_block(tmp_path: Path, delay_s: float) -> None:
    spec = ArenaSpec("kill", "cpu0", 8 * SLAB_BYTES, SLAB_BYTES, 8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        neighbour = PooledSlabs(arena.table, "neighbour", FMT_A)
        kept = neighbour.alloc(2)
        ready = _CTX.Event()
        victim = _CTX.Process(target=_victim, args=(str(tmp_path), ready))
        victim.start()
        assert ready.wait(60), "victim attached"
        time.sleep(delay_s)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        marks = {int(m) for m in np.unique(arena.table.block_owner)} - {0, neighbour.mark}
        assert marks, "the dead victim still holds blocks, cached ones among them"
        assert arena.table.reclaim_dead_owners() == ["victim"]
        check_integrity(arena.table)
        assert set(np.unique(arena.table.block_owner).tolist()) <= {0, neighbour.mark}, (
            "every block marked the victim's, handed out or cached, went back")
        neighbour.free(kept)
        neighbour.release_cache()
        _check(neighbour)
        assert snapshot(arena.table).free_slabs == 8, "nothing leaked"
        everything = PooledSlabs(arena.table, "next", FMT_A, cache_blocks=0).alloc(64)
        assert len(everything) == 64, "all of it reusable"

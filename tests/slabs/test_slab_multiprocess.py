"""Cross-process: 4 runtimes x 25,000 operations on one table, and a runtime killed by SIGKILL;
each with slabs of their own, and with key pools (two runtimes sharing FMT_A's slabs).

Each stress worker stamps the first and last byte of every block it holds with its own mark and
checks the marks before freeing: two runtimes handed the same bytes would overwrite each other.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from slab_constants import FMT_A, FMT_B, SLAB_BYTES
from stamps import check_stamps, stamp

from fineslab.errors import ArenaExhausted
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.client import RuntimeSlabs
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.pooled import PooledSlabs

NUM_WORKERS = 4
OPS_PER_WORKER = 25_000
STRESS_SLABS = 24
_CTX = mp.get_context("spawn")


def _stress_worker(shm_dir: str, index: int, pooled: bool, queue: mp.Queue) -> None:
    fmt = FMT_A if index % 2 == 0 else FMT_B
    attach = PooledSlabs.attach if pooled and index != 1 else RuntimeSlabs.attach
    rt = attach("stress", "cpu0", f"r{index}", fmt, shm_dir=Path(shm_dir))
    data = np.memmap(rt.table.path.with_suffix(".arena"), dtype=np.uint8, mode="r+")
    rng = np.random.default_rng(1000 + index)
    stride, mark = fmt.block_stride_bytes, index + 1
    live: list[np.ndarray] = []
    exhausted = 0
    for op in range(OPS_PER_WORKER):
        if live and rng.random() < len(live) / (len(live) + 8):
            blocks = live.pop(int(rng.integers(len(live))))
            check_stamps(data, blocks, stride, mark)
            rt.free(blocks)
        else:
            num_blocks = 1 if rng.random() < 0.7 else int(rng.integers(2, 17))
            try:
                blocks = np.asarray(rt.alloc(num_blocks), dtype=np.int64)
            except ArenaExhausted:
                exhausted += 1
                continue
            stamp(data, blocks, stride, mark)
            live.append(blocks)
        if op % 50 == 0:
            rt.check_integrity()
    for blocks in live:
        rt.free(blocks)
    rt.check_integrity()
    rt.close()
    queue.put((index, exhausted))


@pytest.mark.parametrize("pooled", [False, True], ids=["private", "key-pools"])
def test_four_processes_share_the_table_without_conflict(tmp_path: Path, pooled: bool) -> None:
    """key-pools: r0 and r2 share FMT_A's pool, r3 is alone in FMT_B's, r1 keeps its own."""
    spec = ArenaSpec("stress", "cpu0", STRESS_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        queue: mp.Queue = _CTX.Queue()
        workers = [_CTX.Process(target=_stress_worker, args=(str(tmp_path), i, pooled, queue))
                   for i in range(NUM_WORKERS)]
        for worker in workers:
            worker.start()
        checks = 0
        shared = 0
        while any(w.is_alive() for w in workers):
            check_integrity(arena.table, exact_owners=[])  # global invariants, mid-run
            marks = arena.table.block_owner.astype(np.int64)
            lowest = np.where(marks == 0, 256, marks).min(axis=1)
            shared += int(((marks.max(axis=1) > 0) & (lowest != marks.max(axis=1))).any())
            checks += 1
            time.sleep(0.02)
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0, "every worker finished its 25,000 operations cleanly"
        results = dict(queue.get(timeout=5) for _ in workers)
        check_integrity(arena.table)
        assert snapshot(arena.table).free_slabs == STRESS_SLABS, "everything came back"
        assert checks > 3, "the table was checked while the workers ran"
        assert sum(results.values()) > 0, "the arena ran full at times (carve failure path)"
        if pooled:
            assert shared > 0, "two runtimes (r0, r2) held blocks of one slab at the same time"


def _victim(shm_dir: str, pooled: bool, ready: mp.synchronize.Event) -> None:
    attach = PooledSlabs.attach if pooled else RuntimeSlabs.attach
    rt = attach("kill", "cpu0", "victim", FMT_A, shm_dir=Path(shm_dir))
    rt.alloc(20)  # 2.5 slabs: the churn below carves and returns slab 3 under the lock
    ready.set()
    while True:
        rt.free(rt.alloc(8))


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2])
@pytest.mark.parametrize("pooled", [False, True], ids=["private", "key-pool"])
def test_sigkilled_runtime_leaks_nothing(tmp_path: Path, delay_s: float, pooled: bool) -> None:
    """key-pool: the victim and a pooled neighbour share FMT_A's slabs; only the victim's
    blocks go, the neighbour's stay where they are."""
    spec = ArenaSpec("kill", "cpu0", 8 * SLAB_BYTES, SLAB_BYTES, 8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        survivor = arena.client("survivor", FMT_B)
        survivor.alloc(3)
        neighbour = arena.client("neighbour", FMT_A, pooled=True) if pooled else None
        kept = neighbour.alloc(3) if neighbour is not None else []
        ready = _CTX.Event()
        victim = _CTX.Process(target=_victim, args=(str(tmp_path), pooled, ready))
        victim.start()
        assert ready.wait(60), "victim attached"
        time.sleep(delay_s)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.05)
        # not joined yet: the victim is a zombie, which counts as dead
        assert arena.table.reclaim_dead_owners() == ["victim"]
        check_integrity(arena.table)
        victim.join()
        if neighbour is not None:
            assert neighbour.num_used_blocks() == 3, "the neighbour's blocks are untouched"
            neighbour.free(kept)
            assert neighbour.release_cache() > 0, "what its block cache held goes back too"
            check_integrity(arena.table)
        assert snapshot(arena.table).free_slabs == 7, "only the survivor's slab is held"
        assert len(arena.client("next", FMT_A).alloc(7 * 8)) == 56, "all of it reusable"


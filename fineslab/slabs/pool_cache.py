"""BlockCache: a key-pool runtime's private stock of pool blocks (the magazine of pooled.py).

Why: every change to a POOLED slab takes the table lock (an flock pair and a thread lock), so
two runtimes of one key pool that allocate back to back wait for each other on nearly every
call: 5.3x SGLang's private allocator in wall time (docs/slabs.md, `pooled_ratio`). A cache
moves blocks between the pool and the runtime in batches, under one lock acquisition, and serves
single allocations and frees from process-local state, without the lock and without writing the
table; like the per-CPU magazines of a slab allocator, or RuntimeSlabs' own slabs.

What a neighbour sees: a cached block is marked this runtime's in `block_owner` (free_map 0),
exactly as a block it handed out, so for the table, `check_integrity` (T6), the snapshot and
/metrics it is USED by this runtime; a dead runtime's cache is reclaimed with its other blocks
(table.py drops every block marked slot + 1), and a lock-holder's death repairs it the same way.
The memory hidden from neighbours is at most `capacity` blocks (pooled.py: one slab's worth) a
runtime, given back when the runtime goes idle (`PooledSlabs.release_cache`, called by the
plugin's idle check) or at its next call after a neighbour came up short (the table's pool
squeeze counter).

Glossary
    cached block   a block marked this runtime's that no caller of the runtime holds
    capacity       the most blocks the cache holds
    target         what a refill or a spill leaves in the cache (capacity // 2): room both ways,
                   so runs of decode pages and of small frees seldom take the lock

Layout (a stack: `take` pops the top, `put` pushes there, so a freed block is reused first)

    stack: [ b0 b1 ... b(size-1) | unused ... ]      0 <= size <= capacity
                             top ^

Invariants (`check`)
    0 <= size <= capacity
    mask[b] == 1  <=>  b in stack[:size]          (so the blocks there are distinct)

Cost: `take` and `put` are a slice copy and a mask write (about a microsecond); `spill` sorts
at most capacity + the freed ids. Memory: one byte per block of the arena (the mask), the size
of one free-map row per slab. Not thread-safe, like RuntimeSlabs.
"""

from __future__ import annotations

import numpy as np

from fineslab.errors import ConfigError, IntegrityError


class BlockCache:
    """At most `capacity` block ids of `num_blocks_total`, process-local (no table access)."""

    def __init__(self, capacity: int, num_blocks_total: int) -> None:
        if capacity < 0:
            raise ConfigError(f"block cache: capacity {capacity} is negative")
        self.capacity = capacity
        self.target = capacity // 2
        self.size = 0
        self._stack = np.empty(capacity, dtype=np.int64)
        self._mask = np.zeros(num_blocks_total if capacity else 0, dtype=bool)

    def take(self, num_blocks: int) -> np.ndarray:
        """Pop `num_blocks` (<= size) ids off the top."""
        low = self.size - num_blocks
        out = self._stack[low: self.size].copy()
        self._mask[out] = False
        self.size = low
        return out

    def put(self, block_ids: np.ndarray) -> bool:
        """Push `block_ids` (not cached, distinct); False, nothing changed, when they do not fit."""
        high = self.size + block_ids.size
        if high > self.capacity:
            return False
        self._stack[self.size: high] = block_ids
        self._mask[block_ids] = True
        self.size = high
        return True

    def holds_any(self, block_ids: np.ndarray) -> bool:
        return bool(self.size) and bool(self._mask[block_ids].any())

    def spill(self, block_ids: np.ndarray) -> np.ndarray:
        """Add `block_ids` (not cached, distinct), keep the `target` lowest ids of all and return
        the rest, ascending: the blocks of the highest slabs go back, so high slabs drain."""
        every = np.sort(np.concatenate([self._stack[: self.size], block_ids]))
        keep, give = every[: self.target], every[self.target:]
        self._mask[self._stack[: self.size]] = False
        self._reset(keep)
        return give

    def drain(self) -> np.ndarray:
        """Empty the cache; its ids, ascending."""
        out = np.sort(self._stack[: self.size])
        self._mask[out] = False
        self.size = 0
        return out

    def contents(self) -> np.ndarray:
        return self._stack[: self.size].copy()

    def _reset(self, keep: np.ndarray) -> None:
        """Hold exactly `keep` (ascending), the lowest on top so that it is handed out first."""
        self.size = keep.size
        self._stack[: keep.size] = keep[::-1]
        self._mask[keep] = True

    def check(self) -> None:
        """The invariants above; IntegrityError names the one broken."""
        if not 0 <= self.size <= self.capacity:
            raise IntegrityError(f"block cache holds {self.size} of {self.capacity} blocks")
        held = self._stack[: self.size]
        if np.unique(held).size != held.size:
            raise IntegrityError("block cache holds a block twice")
        if int(self._mask.sum()) != held.size or not self._mask[held].all():
            raise IntegrityError("block cache mask differs from its stack")

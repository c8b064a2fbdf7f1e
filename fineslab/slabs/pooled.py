"""Key pools: runtimes whose blocks have the same stride share the slabs of that key.

FineServe section 5.2: "each slab is keyed by its KV block size ... compatible models share a
slab pool". With a slab pool per runtime (`RuntimeSlabs`), free blocks left in one runtime's
partly used slabs are stranded for every other runtime; replicas of one model, or models whose
page sizes make their blocks equal, lose that memory for nothing. A `PooledSlabs` runtime
instead takes free blocks from any POOLED slab of its key and carves new slabs as POOLED.

Glossary (see table.py for the table's, pool_cache.py for the cache's)
    pool of key k   the slabs with owner == POOLED and key == k
    block id        slab_id * bps + local index (as in client.py: the global page of the view)
    held block      a block marked this runtime's in block_owner: handed out, or cached
    cache           the runtime's private stock of held blocks no caller has (pool_cache.py)

Invariants (T6 in table.py; `check_integrity` verifies them, exactly, since all changes to a
POOLED slab happen under the table lock)
    used[s] == #{j < bps: block_owner[s, j] != 0}
    free_map[s, j] == 1  <=>  block_owner[s, j] == 0          for j < bps
    a POOLED slab with used[s] == 0 is FREE at once (returned in the call that emptied it)
and this runtime's own
    num_held == #{(s, j): block_owner[s, j] == mark} == num_used_blocks() + cache.size
    every cached block is held;  cache.size <= cache capacity <= bps

Cost: an allocation the cache covers (fewer than a slab's blocks, no hint) and a free the cache
has room for touch no shared state but one header word: no lock. Otherwise one lock acquisition
(an flock pair and a thread lock) moves blocks both ways at once: an allocation takes what it
needs and refills the cache to half its capacity; a free that overflows the cache keeps the
lowest half-capacity ids and returns the rest. Under the lock a call looks at the pool's slabs
only: their ids are cached by the table's slab epoch (which moves only when some slab is carved
or freed), and a batch that fits the lowest partial slab takes it from there directly. A
runtime alone on its key keeps the lock-free `RuntimeSlabs`. Measured in docs/slabs.md
(`python -m fineslab.bench.alloc`: `pooled_ratio_cpu`, CPU time, and `pooled_ratio`, wall time,
which counts waiting on the lock).

The cache's price: up to one slab's worth of blocks a runtime, held and counted as USED by it
for every neighbour (snapshot, /metrics, their `available_blocks`), though no request of it
has them. They go back when the plugin finds the runtime idle (`release_cache`), when a pooled
runtime came up short (it moves the table's pool squeeze counter, and every pooled runtime
gives its cache back at its next call), on close, and with a dead runtime's other blocks.
`cache_blocks=0` turns the cache off: every call under the lock, blocks placed exactly.

Placement follows RuntimeSlabs: a prefill of a slab or more takes whole fresh slabs for its
whole-slab part; a hinted batch (decode) fills the hint's slab first (a hinted call bypasses
the cache); the rest comes from the cache, then the lowest partial slabs of the pool, so high
slabs drain and go back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from fineslab.errors import ArenaExhausted, ConfigError, IntegrityError, InvalidBlockError
from fineslab.slabs.client import RuntimeStats, SlabClient
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.pool_cache import BlockCache
from fineslab.slabs.table import PADDING_SLAB, POOLED, SlabState, SlabTable

logger = logging.getLogger(__name__)

# plain ints: comparing a numpy array with an IntEnum member costs an enum lookup per call
_FREE, _PARTIAL, _FULL = int(SlabState.FREE), int(SlabState.PARTIAL), int(SlabState.FULL)


def _contains(sorted_ids: np.ndarray, value: int) -> bool:
    at = int(np.searchsorted(sorted_ids, value))
    return at < sorted_ids.size and int(sorted_ids[at]) == value


class PooledSlabs(SlabClient):
    """The block allocator of one runtime that shares its key's slabs with other runtimes.

    `cache_blocks`: the capacity of its block cache (None: one slab's worth, the most allowed;
    0: no cache, every call under the table lock).
    """

    pooled = True

    def __init__(self, table: SlabTable, runtime_id: str, fmt: BlockFormat,
                 owns_table: bool = False, cache_blocks: int | None = None) -> None:
        bps = fmt.blocks_per_slab(table.dims.slab_bytes)
        capacity = bps if cache_blocks is None else cache_blocks
        if not 0 <= capacity <= bps:
            raise ConfigError(f"{runtime_id}: a block cache of {capacity} blocks is outside "
                              f"[0, {bps}] (one slab's worth at most)")
        super().__init__(table, runtime_id, fmt, owns_table)
        self.key = fmt.block_stride_bytes
        self.mark = self.slot + 1  # this runtime's value in block_owner
        self._num_held = 0  # blocks marked its own (handed out + cached): the KV limit reads it
        self._cache = BlockCache(capacity, self.num_blocks_total)
        self._squeeze_seen = table.pool_squeeze
        self.num_locked_calls = 0  # alloc/free calls that took the table lock (the bench reads)
        # The pool's slabs (owner POOLED, this key), ascending, as of slab epoch
        # `_pool_epoch`: refreshed under the lock when the epoch moved (a slab was carved or
        # freed anywhere), so most calls scan the pool's slabs only, not the whole table.
        self._pool_epoch = -1
        self._pool_ids = np.empty(0, dtype=np.int64)

    # -- allocation -----------------------------------------------------------------------------
    def alloc_array(self, num_blocks: int, near_block: int | None = None) -> np.ndarray:
        """`num_blocks` block ids, all or none; ArenaExhausted (nothing changed but the pool
        squeeze counter) when short. From the cache without the lock when it covers them."""
        if num_blocks < 0:
            raise InvalidBlockError(f"cannot allocate {num_blocks} blocks")
        if num_blocks == 0:
            return np.empty(0, dtype=np.int64)
        if num_blocks <= self._cache.size and num_blocks < self.blocks_per_slab and \
                near_block is None and self.table.pool_squeeze == self._squeeze_seen:
            return self._cache.take(num_blocks)
        return self._alloc_locked(num_blocks, near_block)

    def _alloc_locked(self, num_blocks: int, near_block: int | None) -> np.ndarray:
        """The cache's blocks first (not for a hint), the rest and the cache's refill from the
        pool, under one lock acquisition."""
        bps, cache = self.blocks_per_slab, self._cache
        whole = 0 if near_block is not None else num_blocks // bps
        with self.table.lock():
            self.num_locked_calls += 1
            squeezed = self._obey_squeeze_locked()
            from_cache = 0 if near_block is not None else min(cache.size, num_blocks - whole * bps)
            need = num_blocks - from_cache
            room = self._limit_room()
            if room is not None and need > room:
                raise ArenaExhausted(
                    f"{self.runtime_id}: {num_blocks} block(s) wanted beyond its KV limit of "
                    f"{self.table.kv_limit(self.slot)} B ({self._num_held} held, "
                    f"{cache.size} of them cached)")
            # no refill for a hint, nor right after a neighbour asked for the caches back
            refill = 0 if near_block is not None or squeezed else \
                cache.target - (cache.size - from_cache)
            if room is not None:
                refill = min(refill, room - need)
            try:
                taken = self._draw_locked(need, whole, near_block, max(0, refill))
            except ArenaExhausted:
                self._squeeze_seen = self.table.squeeze_pools_locked()
                raise
            self._num_held += taken.size
            head = cache.take(from_cache)
            if not cache.put(taken[need:][::-1]):  # the lowest on top: handed out first
                raise IntegrityError(f"{self.runtime_id}: a refill overflowed its cache")
            mine = taken[:need]
            return mine if not from_cache else np.concatenate([head, mine])

    def _draw_locked(self, need: int, whole: int, near_block: int | None, refill: int
                     ) -> np.ndarray:
        """`need` blocks, then up to `refill` more where the pool (and what a carve for `need`
        brings) has them: ids for the caller first, the refill after. `whole` of them as whole
        fresh slabs when those are there."""
        bps, used = self.blocks_per_slab, self.table.used
        partial = self._pool_partial(locked=True)
        if near_block is None and need < bps and partial.size:
            # The common case (a decode page, a short prefill): the lowest partial slab has
            # room, which is where the general path below would take them from too.
            lowest = int(partial[0])
            free_there = bps - int(used[lowest])
            if free_there >= need:
                total = min(free_there, need + refill)
                return self._take_from(lowest, total) if total else np.empty(0, np.int64)
        pool_free = int(bps * partial.size - used[partial].sum())
        whole_slabs, fresh = self._carve(need, whole, pool_free)
        spare = pool_free + (whole_slabs.size + fresh.size) * bps - need
        total = need + min(refill, spare)
        if not total:
            return np.empty(0, dtype=np.int64)
        if fresh.size:
            partial = np.union1d(partial, fresh)
        first = whole_slabs.tolist()
        near = near_block // bps if near_block is not None else None
        if near is not None and _contains(partial, near):
            first.append(near)
        return self._take(first, partial, total)

    def limit_blocks(self) -> int | None:
        """The most blocks its KV limit lets it hold, None without a limit."""
        limit = self.table.kv_limit(self.slot)
        return None if limit is None else limit // self.key

    def _limit_room(self) -> int | None:
        """Blocks it may still take from the pool under its KV limit (None: no limit); cached
        blocks count as held, its padding-slab blocks do not."""
        limit = self.limit_blocks()
        return None if limit is None else max(0, limit - self._num_held + self._padding_held())

    def _padding_held(self) -> int:
        """Its blocks in the padding slab (slab 0): parked by the allocator for SGLang's padded
        writes, never KV it can use, so not counted against its KV limit."""
        if int(self.table.owner[PADDING_SLAB]) != POOLED:
            return 0
        return int(np.count_nonzero(self.table.block_owner[PADDING_SLAB] == self.mark))

    def _pool_slabs(self, locked: bool) -> np.ndarray:
        """The pool's slabs, ascending; cached by slab epoch, the cache refreshed only by a
        caller holding the lock (a lock-free reader may see a carve half done)."""
        t = self.table
        if t.slab_epoch == self._pool_epoch:
            return self._pool_ids
        epoch = t.slab_epoch
        ids = np.flatnonzero((t.key == self.key) & (t.owner == POOLED))
        if locked:
            self._pool_epoch, self._pool_ids = epoch, ids
        return ids

    def _pool_partial(self, locked: bool = False) -> np.ndarray:
        """The pool's slabs with a free block, ascending."""
        ids = self._pool_slabs(locked)
        return ids[self.table.state[ids] == _PARTIAL]

    def _carve(self, num_blocks: int, whole: int, pool_free: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """Fresh POOLED slabs: (`whole` slabs for the batch's whole-slab part, the slabs the
        pool lacks beyond them); without whole slabs when the free space is short of them."""
        bps = self.blocks_per_slab
        if whole:
            extra = -(-max(0, num_blocks - whole * bps - pool_free) // bps)
            try:
                carved = self.table.carve_locked(self.slot, whole + extra, POOLED)
            except ArenaExhausted:
                pass
            else:
                return carved[:whole], carved[whole:]
        none = np.empty(0, dtype=np.int64)
        short = num_blocks - pool_free
        if short <= 0:
            return none, none
        return none, self.table.carve_locked(self.slot, -(-short // bps), POOLED)

    def _take(self, first: list[int], partial: np.ndarray, num_blocks: int) -> np.ndarray:
        """Take `num_blocks` free blocks from the slabs `first`, then the `partial` ones in
        order (together they hold enough)."""
        out, remaining = [], num_blocks
        for slab in first:
            out.append(self._take_from(slab, remaining))
            remaining -= out[-1].size
        for slab in partial.tolist():
            if not remaining:
                break
            if slab not in first:
                out.append(self._take_from(slab, remaining))
                remaining -= out[-1].size
        if remaining:
            raise IntegrityError(f"{self.runtime_id}: pool of key {self.key} is short of "
                                 f"{remaining} blocks it counted as free")
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _take_from(self, slab: int, num_blocks: int) -> np.ndarray:
        """Up to `num_blocks` free blocks of pool slab `slab`, lowest first."""
        t, bps = self.table, self.blocks_per_slab
        row = t.free_map[slab, :bps]
        if num_blocks == 1:  # the decode case: scalar operations only
            j = int(row.argmax())
            row[j] = 0
            t.block_owner[slab, j] = self.mark
            taken = 1
            out = np.array([slab * bps + j], dtype=np.int64)
        else:
            local = row.nonzero()[0][:num_blocks]
            row[local] = 0
            t.block_owner[slab, local] = self.mark
            taken = local.size
            out = local + slab * bps
        now_used = int(t.used[slab]) + taken
        t.used[slab] = now_used
        if now_used == bps:
            t.state[slab] = _FULL
        return out

    # -- free -----------------------------------------------------------------------------------
    def free(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Give blocks back; InvalidBlockError (nothing changed) on a foreign, free or repeat id.
        Into the cache without the lock while it has room; else, under the lock, the cache
        keeps the lowest half-capacity ids and the rest go back to the pool."""
        ids = self._sorted_ids(block_ids)
        if ids.size == 0:
            return
        self._validate_free(ids)
        if self.table.pool_squeeze == self._squeeze_seen and self._cache.put(ids):
            return
        with self.table.lock():
            self.num_locked_calls += 1
            if self._obey_squeeze_locked():
                self._return_locked(ids)  # a neighbour is short: keep none
            else:
                self._return_locked(self._cache.spill(ids))

    def _validate_free(self, ids: np.ndarray) -> None:
        """Without the lock: a block marked this runtime's stays so until it frees it (only
        its own calls and the reclaim of a dead runtime change its marks)."""
        self._check_range(ids)
        self._check_no_repeat(ids)
        slabs, local = np.divmod(ids, self.blocks_per_slab)
        t = self.table
        holder = t.block_owner[slabs, local]
        cached = self._cache.holds_any(ids)
        if not cached and bool((holder == self.mark).all()):
            return  # a block marked ours lies in a POOLED slab of our key (T6)
        in_pool = (t.owner[slabs] == POOLED) & (t.key[slabs] == self.key)
        if not in_pool.all():
            bad = ids[~in_pool][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are not in its key pool")
        if (holder == 0).any() or cached:
            free = (holder == 0) | np.array([self._cache.holds_any(ids[i: i + 1])
                                             for i in range(ids.size)])
            bad = ids[free][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are already free")
        bad = ids[holder != self.mark][:8].tolist()
        raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are another runtime's")

    def _return_locked(self, ids: np.ndarray) -> None:
        """Give held blocks `ids` (ascending) back to the pool; an emptied slab goes FREE."""
        if ids.size == 0:
            return
        t = self.table
        slabs, local = np.divmod(ids, self.blocks_per_slab)
        t.block_owner[slabs, local] = 0
        t.free_map[slabs, local] = 1
        starts = np.flatnonzero(np.diff(slabs, prepend=-1))
        counts = np.diff(starts, append=ids.size)
        for slab, count in zip(slabs[starts].tolist(), counts.tolist(), strict=True):
            t.used[slab] -= count
            if t.used[slab] == 0:
                t.release_locked(slab)
            else:
                t.state[slab] = _PARTIAL
        self._num_held -= ids.size

    # -- the cache's give-back ------------------------------------------------------------------
    def _obey_squeeze_locked(self) -> bool:
        """Give the whole cache back if a pooled runtime came up short since the last call."""
        squeeze = self.table.pool_squeeze
        if squeeze == self._squeeze_seen:
            return False
        self._squeeze_seen = squeeze
        if self._cache.size:
            logger.debug("%s: a key-pool runtime came up short; giving back %d cached "
                         "block(s)", self.runtime_id, self._cache.size)
            self._return_locked(self._cache.drain())
        return True

    def release_cache(self) -> int:
        """Give every cached block back to the pool; returns how many. The plugin calls it when
        its runtime is idle: an idle runtime needs no stock, and a neighbour may."""
        if not self._cache.size:
            return 0
        with self.table.lock():
            ids = self._cache.drain()
            self._return_locked(ids)
            return int(ids.size)

    # -- accounting (lock-free reads: exact when the pool's runtimes are quiescent) -------------
    def num_cached_blocks(self) -> int:
        """Blocks in its cache: held (USED for the table and the neighbours), handed to no one."""
        return self._cache.size

    def num_free_blocks(self) -> int:
        """Free blocks it can take without carving: the pool's partly used slabs' (shared with
        the pool's runtimes) and its own cache's."""
        partial = self._pool_partial()
        pool_free = int(self.blocks_per_slab * partial.size - self.table.used[partial].sum())
        return pool_free + self._cache.size

    def available_blocks(self) -> int:
        """Its free blocks plus what the free slabs would give it now, within its KV limit."""
        free_slabs = int(np.count_nonzero(self.table.state == _FREE))
        available = self.num_free_blocks() + free_slabs * self.blocks_per_slab
        room = self._limit_room()
        return available if room is None else min(available, room + self._cache.size)

    def _held(self) -> np.ndarray:
        """This runtime's blocks, row by POOLED slab (only those rows hold block owners)."""
        return self.table.block_owner[self.table.owner == POOLED] == self.mark

    def num_used_blocks(self) -> int:
        """Blocks it handed out and not yet freed (its cache not counted)."""
        return self._num_held - self._cache.size

    def stats(self) -> RuntimeStats:
        snap = snapshot(self.table)
        num_slabs = int(np.count_nonzero(self._held().any(axis=1)))
        return RuntimeStats(self.runtime_id, self.num_used_blocks(), self.num_free_blocks(),
                            num_slabs, self.key, snap.free_slabs, snap.owners)

    def check_integrity(self) -> None:
        """The table's invariants (exact for POOLED slabs: they change only under the lock),
        then its own: held count, and every cached block held by it."""
        check_integrity(self.table, exact_owners=[self.slot])
        marked = int(np.count_nonzero(self._held()))
        if self._num_held != marked:
            raise IntegrityError(f"{self.runtime_id}: holds {marked} block(s), counted "
                                 f"{self._num_held}")
        self._cache.check()
        cached = self._cache.contents()
        slabs, local = np.divmod(cached, self.blocks_per_slab)
        if cached.size and not bool((self.table.block_owner[slabs, local] == self.mark).all()):
            raise IntegrityError(f"{self.runtime_id}: a cached block is not marked its own")

    def _forget(self) -> None:
        """After close: every block it held, cached ones too, went back with its slot."""
        self._cache.drain()
        self._num_held = 0

"""Key pools: runtimes whose blocks have the same stride share the slabs of that key.

FineServe section 5.2: "each slab is keyed by its KV block size ... compatible models share a
slab pool". With a slab pool per runtime (`RuntimeSlabs`), free blocks left in one runtime's
partly used slabs are stranded for every other runtime; replicas of one model, or models whose
page sizes make their blocks equal, lose that memory for nothing. A `PooledSlabs` runtime
instead takes free blocks from any POOLED slab of its key and carves new slabs as POOLED.

Glossary (see table.py for the table's)
    pool of key k   the slabs with owner == POOLED and key == k
    block id        slab_id * bps + local index (as in client.py: the global page of the view)

Invariants (T6 in table.py; `check_integrity` verifies them, exactly, since all changes to a
POOLED slab happen under the table lock)
    used[s] == #{j < bps: block_owner[s, j] != 0}
    free_map[s, j] == 1  <=>  block_owner[s, j] == 0          for j < bps
    a POOLED slab with used[s] == 0 is FREE at once (returned in the call that emptied it)

Cost: every alloc and free takes the table lock (an flock pair and a thread lock) and looks at
the pool's slabs: their ids are cached by the table's slab epoch (which moves only when some
slab is carved or freed), so a call reads the state of the pool's slabs, not the whole table,
and a batch that fits the lowest partial slab takes it from there directly. That is the price
of sharing; a runtime alone on its key keeps the lock-free `RuntimeSlabs`. Measured in
docs/slabs.md (`python -m fineslab.bench.alloc`: `pooled_ratio_cpu`, CPU time, and
`pooled_ratio`, wall time, which counts waiting on the lock).

Placement follows RuntimeSlabs: a prefill of a slab or more takes whole fresh slabs for its
whole-slab part; a hinted batch (decode) fills the hint's slab first; the rest comes from the
lowest partial slabs of the pool, so high slabs drain and go back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from fineslab.errors import ArenaExhausted, IntegrityError, InvalidBlockError
from fineslab.slabs.client import RuntimeStats, SlabClient
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.table import POOLED, SlabState, SlabTable

logger = logging.getLogger(__name__)

# plain ints: comparing a numpy array with an IntEnum member costs an enum lookup per call
_FREE, _PARTIAL, _FULL = int(SlabState.FREE), int(SlabState.PARTIAL), int(SlabState.FULL)


def _contains(sorted_ids: np.ndarray, value: int) -> bool:
    at = int(np.searchsorted(sorted_ids, value))
    return at < sorted_ids.size and int(sorted_ids[at]) == value


class PooledSlabs(SlabClient):
    """The block allocator of one runtime that shares its key's slabs with other runtimes."""

    pooled = True

    def __init__(self, table: SlabTable, runtime_id: str, fmt: BlockFormat,
                 owns_table: bool = False) -> None:
        super().__init__(table, runtime_id, fmt, owns_table)
        self.key = fmt.block_stride_bytes
        self.mark = self.slot + 1  # this runtime's value in block_owner
        self._num_held = 0  # blocks it holds: the KV limit check reads it per call
        # The pool's slabs (owner POOLED, this key), ascending, as of slab epoch
        # `_pool_epoch`: refreshed under the lock when the epoch moved (a slab was carved or
        # freed anywhere), so most calls scan the pool's slabs only, not the whole table.
        self._pool_epoch = -1
        self._pool_ids = np.empty(0, dtype=np.int64)

    # -- allocation -----------------------------------------------------------------------------
    def alloc_array(self, num_blocks: int, near_block: int | None = None) -> np.ndarray:
        """`num_blocks` block ids, all or none; ArenaExhausted (nothing changed) when short."""
        if num_blocks < 0:
            raise InvalidBlockError(f"cannot allocate {num_blocks} blocks")
        if num_blocks == 0:
            return np.empty(0, dtype=np.int64)
        bps = self.blocks_per_slab
        with self.table.lock():
            room = self._limit_room()
            if room is not None and num_blocks > room:
                raise ArenaExhausted(
                    f"{self.runtime_id}: {num_blocks} block(s) wanted beyond its KV limit of "
                    f"{self.table.kv_limit(self.slot)} B ({self._num_held} held)")
            partial = self._pool_partial(locked=True)
            if near_block is None and num_blocks < bps and partial.size:
                # The common case (a decode page, a short prefill): the lowest partial slab
                # has room, which is where the general path below would take them from too.
                lowest = int(partial[0])
                if bps - int(self.table.used[lowest]) >= num_blocks:
                    taken = self._take_from(lowest, num_blocks)
                    self._num_held += num_blocks
                    return taken
            pool_free = int(bps * partial.size - self.table.used[partial].sum())
            whole = 0 if near_block is not None else num_blocks // bps
            whole_slabs, fresh = self._carve(num_blocks, whole, pool_free)
            if fresh.size:
                partial = np.union1d(partial, fresh)
            first = whole_slabs.tolist()
            near = near_block // bps if near_block is not None else None
            if near is not None and _contains(partial, near):
                first.append(near)
            taken = self._take(first, partial, num_blocks)
            self._num_held += num_blocks
            return taken

    def limit_blocks(self) -> int | None:
        """The most blocks its KV limit lets it hold, None without a limit."""
        limit = self.table.kv_limit(self.slot)
        return None if limit is None else limit // self.key

    def _limit_room(self) -> int | None:
        """Blocks it may still take under its KV limit (None: no limit)."""
        limit = self.limit_blocks()
        return None if limit is None else max(0, limit - self._num_held)

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
        """Give blocks back; InvalidBlockError (nothing changed) on a foreign, free or repeat id."""
        ids = self._sorted_ids(block_ids)
        if ids.size == 0:
            return
        t = self.table
        with t.lock():
            slabs, local = self._validate_free(ids)
            t.block_owner[slabs, local] = 0
            t.free_map[slabs, local] = 1
            touched, counts = np.unique(slabs, return_counts=True)
            for slab, count in zip(touched.tolist(), counts.tolist(), strict=True):
                t.used[slab] -= count
                if t.used[slab] == 0:
                    t.release_locked(slab)
                else:
                    t.state[slab] = _PARTIAL
            self._num_held -= ids.size

    def _validate_free(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._check_range(ids)
        self._check_no_repeat(ids)
        slabs, local = np.divmod(ids, self.blocks_per_slab)
        t = self.table
        in_pool = (t.owner[slabs] == POOLED) & (t.key[slabs] == self.key)
        if not in_pool.all():
            bad = ids[~in_pool][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are not in its key pool")
        holder = t.block_owner[slabs, local]
        if (holder == 0).any():
            bad = ids[holder == 0][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are already free")
        if (holder != self.mark).any():
            bad = ids[holder != self.mark][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are another runtime's")
        return slabs, local

    # -- accounting (lock-free reads: exact when the pool's runtimes are quiescent) -------------
    def num_free_blocks(self) -> int:
        """Free blocks in the pool's partly used slabs (shared with the pool's runtimes)."""
        partial = self._pool_partial()
        return int(self.blocks_per_slab * partial.size - self.table.used[partial].sum())

    def available_blocks(self) -> int:
        """Free blocks of the pool plus what the free slabs would give this runtime now."""
        free_slabs = int(np.count_nonzero(self.table.state == _FREE))
        available = self.num_free_blocks() + free_slabs * self.blocks_per_slab
        room = self._limit_room()
        return available if room is None else min(available, room)

    def _held(self) -> np.ndarray:
        """This runtime's blocks, row by POOLED slab (only those rows hold block owners)."""
        return self.table.block_owner[self.table.owner == POOLED] == self.mark

    def num_used_blocks(self) -> int:
        return int(np.count_nonzero(self._held()))

    def stats(self) -> RuntimeStats:
        snap = snapshot(self.table)
        num_slabs = int(np.count_nonzero(self._held().any(axis=1)))
        return RuntimeStats(self.runtime_id, self.num_used_blocks(), self.num_free_blocks(),
                            num_slabs, self.key, snap.free_slabs, snap.owners)

    def check_integrity(self) -> None:
        """The table's invariants (exact for POOLED slabs: they change only under the lock)."""
        check_integrity(self.table, exact_owners=[self.slot])
        if self._num_held != self.num_used_blocks():
            raise IntegrityError(f"{self.runtime_id}: holds {self.num_used_blocks()} block(s), "
                                 f"counted {self._num_held}")

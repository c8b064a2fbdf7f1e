"""RuntimeSlabs: one runtime's block allocator over the shared slab table (the hot path).

Each runtime keeps the slabs it holds, like the per-CPU magazines of a slab allocator: it hands
out and takes back blocks in them without the table lock, and takes the lock only to carve a new
slab (when its own free blocks run short) or to return a slab that became empty (at once).

Glossary (see table.py for the table's)
    block id    slab_id * bps + local block index == the global page index of the format's view
    partial     this runtime's slabs with at least one free block, kept sorted by slab id;
                blocks come from the lowest-id slab first, so high slabs drain and go back

Invariants (between calls; checked by `check_integrity`)
    num_free_blocks() == sum(bps - used[s] for s owned)
    s in partial  <=>  s owned and used[s] < bps
    every owned slab has used[s] > 0 (an empty slab is returned in the call that emptied it)

Cost (measured in docs/slabs.md): alloc/free of one block is a handful of numpy scalar operations
(a few microseconds); a batch costs one vectorized pass per slab touched. Not thread-safe: one
RuntimeSlabs per scheduler thread.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from fineslab.errors import ArenaExhausted, IntegrityError, InvalidBlockError
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.integrity import OwnerUsage, check_integrity, snapshot
from fineslab.slabs.shm import ArenaPaths
from fineslab.slabs.table import PADDING_SLAB, SlabState, SlabTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeStats:
    """This runtime's usage and the device's, in blocks and bytes."""

    runtime_id: str
    used_blocks: int
    free_blocks: int
    num_slabs: int
    block_stride_bytes: int
    free_slabs: int
    owners: tuple[OwnerUsage, ...]

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_stride_bytes


class SlabClient:
    """What every runtime's block allocator shares: registration, attach, the list form of
    alloc, block-id checks, and unregistering on close. `RuntimeSlabs` (slabs of its own) and
    `pooled.PooledSlabs` (its key's pool) differ in where blocks come from."""

    pooled = False

    def __init__(self, table: SlabTable, runtime_id: str, fmt: BlockFormat,
                 owns_table: bool = False) -> None:
        self.table, self.runtime_id, self.fmt = table, runtime_id, fmt
        self._owns_table = owns_table
        self.blocks_per_slab = fmt.blocks_per_slab(table.dims.slab_bytes)
        self.slot = table.register(runtime_id, fmt.block_stride_bytes, pooled=self.pooled)
        self.num_blocks_total = table.dims.num_slabs * self.blocks_per_slab
        self._closed = False

    @classmethod
    def attach(cls, fleet_id: str, device: str, runtime_id: str, fmt: BlockFormat,
               shm_dir: Path | None = None) -> Self:
        """Open the device's table by fleet id and device, and register `runtime_id`."""
        table = SlabTable.open(ArenaPaths.of(fleet_id, device, shm_dir).table)
        return cls(table, runtime_id, fmt, owns_table=True)

    def alloc(self, num_blocks: int, near_block: int | None = None) -> list[int]:
        """`num_blocks` block ids, all or none; raises ArenaExhausted when the arena is short.

        `near_block`: a block the same request already holds (SGLang's last_loc // page_size);
        the new blocks then come from its slab first. A hint only: a stale one is ignored.
        """
        return list(self.alloc_array(num_blocks, near_block).tolist())

    def alloc_array(self, num_blocks: int, near_block: int | None = None) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def _sorted_ids(block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        return np.sort(np.fromiter(block_ids, dtype=np.int64) if not isinstance(
            block_ids, np.ndarray) else block_ids.astype(np.int64).ravel())

    def _check_range(self, ids: np.ndarray) -> None:
        """`ids` sorted and not empty."""
        if ids[0] < 0 or ids[-1] >= self.num_blocks_total:
            raise InvalidBlockError(f"{self.runtime_id}: block id out of range "
                                    f"[0, {self.num_blocks_total}) in free")

    def _check_no_repeat(self, ids: np.ndarray) -> None:
        """`ids` sorted."""
        if ids.size > 1 and not np.all(np.diff(ids)):
            raise InvalidBlockError(f"{self.runtime_id}: a block id repeats in one free")

    def release_cache(self) -> int:
        """Give back the free blocks kept for this runtime's next calls that neighbours could
        use; returns how many. None here: a key pool's block cache (pooled.py) keeps some."""
        return 0

    def padding_slab_free(self) -> bool:
        """Whether the padding slab (slab 0) is in the free space (lock-free read)."""
        return bool(self.table.state[PADDING_SLAB] == SlabState.FREE)

    def close(self) -> None:
        """Unregister: the table frees every block this runtime still holds."""
        if self._closed:
            return
        self._closed = True
        self.table.unregister(self.slot)
        self._forget()
        if self._owns_table:
            self.table.close()

    def _forget(self) -> None:
        """Drop local state after unregistering (none here)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RuntimeSlabs(SlabClient):
    """The block allocator of one runtime (one model replica on one device)."""

    def __init__(self, table: SlabTable, runtime_id: str, fmt: BlockFormat,
                 owns_table: bool = False) -> None:
        super().__init__(table, runtime_id, fmt, owns_table)
        self._width = table.dims.max_blocks_per_slab
        self._flat_free = table.free_map.reshape(-1)
        self._mine = np.zeros(table.dims.num_slabs, dtype=bool)
        self._partial: list[int] = []
        self._num_free = 0
        self._num_slabs = 0  # == count(_mine): the KV limit check reads it per call

    # -- allocation -----------------------------------------------------------------------------

    def alloc_array(self, num_blocks: int, near_block: int | None = None) -> np.ndarray:
        """Like `alloc`, as an int64 array (no Python list: `torch.from_numpy` takes it as is).

        Placement, to keep each slab's blocks few requests' (so slabs empty and go back instead
        of stranding free blocks that other models cannot use):
        a batch with no hint (a prefill) of at least one slab's worth takes whole fresh slabs
        for its whole-slab part, then fills the lowest partial slabs; a hinted batch (decode,
        extend) fills the hint's slab first; the rest comes from the lowest partial slabs.
        """
        if num_blocks < 0:
            raise InvalidBlockError(f"cannot allocate {num_blocks} blocks")
        bps = self.blocks_per_slab
        whole = 0 if near_block is not None else num_blocks // bps
        fresh = self._carve_for(num_blocks, whole)
        parts = [self._take_from(int(slab), bps) for slab in fresh]
        remaining = num_blocks - fresh.size * bps
        if remaining and near_block is not None and self._holds_partial(near_block // bps):
            parts.append(self._take_from(near_block // bps, remaining))
            remaining -= parts[-1].size
        if remaining == 1:
            parts.append(self._take_one())
        elif remaining:
            parts.append(self._take(remaining))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _carve_for(self, num_blocks: int, whole: int) -> np.ndarray:
        """Carve what `num_blocks` needs beyond own free blocks; the `whole` fresh slabs first.

        Falls back to using own free blocks first when the whole slabs are not there.
        """
        bps = self.blocks_per_slab
        if whole:
            extra = -(-max(0, num_blocks - whole * bps - self._num_free) // bps)
            try:
                carved = self.table.carve(self.slot, whole + extra)
            except ArenaExhausted:
                pass
            else:
                self._adopt(carved)
                return carved[:whole]
        short = num_blocks - self._num_free
        if short > 0:
            self._adopt(self.table.carve(self.slot, -(-short // bps)))
        return np.empty(0, dtype=np.int64)

    def _holds_partial(self, slab: int) -> bool:
        return 0 <= slab < self._mine.size and bool(self._mine[slab]) and \
            int(self.table.used[slab]) < self.blocks_per_slab

    def _adopt(self, slabs: np.ndarray) -> None:
        self._mine[slabs] = True
        self._num_slabs += slabs.size
        for slab in slabs.tolist():
            bisect.insort(self._partial, slab)
        self._num_free += slabs.size * self.blocks_per_slab

    def _take_from(self, slab: int, num_blocks: int) -> np.ndarray:
        """Up to `num_blocks` free blocks of own partial `slab`, lowest first."""
        bps, used = self.blocks_per_slab, self.table.used
        row = self.table.free_map[slab, :bps]
        local = row.nonzero()[0][:num_blocks]
        row[local] = 0
        now_used = int(used[slab]) + local.size
        used[slab] = now_used
        if now_used == bps:
            self.table.state[slab] = SlabState.FULL
            self._partial.remove(slab)
        self._num_free -= local.size
        return local + slab * bps

    def _take(self, num_blocks: int) -> np.ndarray:
        """`num_blocks` blocks from the lowest partial slabs (there are enough)."""
        out, remaining = [], num_blocks
        while remaining:
            out.append(self._take_from(self._partial[0], remaining))
            remaining -= out[-1].size
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _take_one(self) -> np.ndarray:
        """The decode case: one block, with scalar operations only."""
        bps, slab = self.blocks_per_slab, self._partial[0]
        row = self.table.free_map[slab]
        local = int(row.argmax())  # the first free block: the slab is partial, so one exists
        row[local] = 0
        now_used = int(self.table.used[slab]) + 1
        self.table.used[slab] = now_used
        if now_used == bps:
            self.table.state[slab] = SlabState.FULL
            del self._partial[0]
        self._num_free -= 1
        return np.array([slab * bps + local], dtype=np.int64)

    # -- free -----------------------------------------------------------------------------------
    def free(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Give blocks back; InvalidBlockError (nothing changed) on a foreign, free or repeat id."""
        ids = self._sorted_ids(block_ids)
        if ids.size == 0:
            return
        slabs, local = np.divmod(ids, self.blocks_per_slab)
        self._validate_free(ids, slabs, local)
        self._flat_free[slabs * self._width + local] = 1
        if ids.size == 1:
            slab = int(slabs[0])
            emptied = [slab] if self._give_back(slab, 1) else []
        else:
            starts = np.flatnonzero(np.diff(slabs, prepend=-1))
            counts = np.diff(starts, append=ids.size)
            emptied = [s for s, c in zip(slabs[starts].tolist(), counts.tolist(), strict=True)
                       if self._give_back(s, c)]
        self._num_free += ids.size
        if emptied:
            self._return(emptied)

    def _validate_free(self, ids: np.ndarray, slabs: np.ndarray, local: np.ndarray) -> None:
        self._check_range(ids)
        if not self._mine[slabs].all():
            bad = ids[~self._mine[slabs]][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are not in its slabs")
        if self._flat_free[slabs * self._width + local].any():
            bad = ids[self._flat_free[slabs * self._width + local] == 1][:8].tolist()
            raise InvalidBlockError(f"{self.runtime_id}: blocks {bad} are already free")
        self._check_no_repeat(ids)

    def _give_back(self, slab: int, count: int) -> bool:
        """Account `count` freed blocks of `slab`; True when the slab became empty."""
        before = int(self.table.used[slab])
        now_used = before - count
        self.table.used[slab] = now_used
        if before == self.blocks_per_slab:
            self.table.state[slab] = SlabState.PARTIAL
            bisect.insort(self._partial, slab)
        return now_used == 0

    def _return(self, slabs: list[int]) -> None:
        self.table.release(self.slot, slabs)
        for slab in slabs:
            self._partial.remove(slab)
            self._mine[slab] = False
        self._num_slabs -= len(slabs)
        self._num_free -= len(slabs) * self.blocks_per_slab

    # -- accounting -----------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Free blocks in this runtime's own slabs (no lock, no shared read)."""
        return self._num_free

    def available_blocks(self) -> int:
        """Own free blocks plus what the free slabs would give this runtime now (lock-free),
        within its KV limit when one is set."""
        free_slabs = int(np.count_nonzero(self.table.state == SlabState.FREE))
        limit = self.table.kv_limit(self.slot)
        if limit is not None:
            counted = self._num_slabs - int(self._mine[PADDING_SLAB])  # slab 0 is not counted
            room = max(0, limit // self.table.dims.slab_bytes - counted)
            free_slabs = min(free_slabs, room)
        return self._num_free + free_slabs * self.blocks_per_slab

    def limit_blocks(self) -> int | None:
        """The most blocks of KV its limit lets it hold (whole slabs; the padding slab's
        blocks, parked, come on top), None without a limit."""
        limit = self.table.kv_limit(self.slot)
        return None if limit is None else limit // self.table.dims.slab_bytes * self.blocks_per_slab

    def num_used_blocks(self) -> int:
        return int(np.count_nonzero(self._mine)) * self.blocks_per_slab - self._num_free

    def stats(self) -> RuntimeStats:
        snap = snapshot(self.table)
        return RuntimeStats(self.runtime_id, self.num_used_blocks(), self._num_free,
                            int(np.count_nonzero(self._mine)), self.fmt.block_stride_bytes,
                            snap.free_slabs, snap.owners)

    def check_integrity(self) -> None:
        """The table's invariants, exact for this runtime's slabs, plus this runtime's own."""
        check_integrity(self.table, exact_owners=[self.slot])
        owned = np.flatnonzero(self.table.owner == self.slot)
        if not np.array_equal(owned, np.flatnonzero(self._mine)) or owned.size != self._num_slabs:
            raise IntegrityError(f"{self.runtime_id}: local slab set differs from the table's")
        used = self.table.used[owned].astype(np.int64)
        if self._num_free != int((self.blocks_per_slab - used).sum()):
            raise IntegrityError(f"{self.runtime_id}: num_free_blocks differs from the table")
        partial = owned[used < self.blocks_per_slab].tolist()
        if partial != self._partial:
            raise IntegrityError(f"{self.runtime_id}: partial list differs from the table")

    # -- lifetime -------------------------------------------------------------------------------
    def _forget(self) -> None:
        """After close: every slab it held went back to the free space (its blocks died)."""
        self._partial, self._num_free, self._num_slabs = [], 0, 0
        self._mine[:] = False

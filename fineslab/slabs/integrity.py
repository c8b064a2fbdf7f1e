"""check_integrity and snapshot: the slab table's invariants verified, and its contents summed.

The invariants T1-T6 are written at the top of `table.py`. `check_integrity` takes the table lock,
so FREE slabs, owners and keys are exact; the block counts of a runtime's slabs (T3, T4) are only
exact while that runtime is not mid-operation, so the caller names the owners it knows to be
quiescent (`exact_owners`; None = all, for a stopped fleet or a single-process test). POOLED
slabs change only under the lock, so their counts and block owners (T3, T4, T6) are always exact.
Cost: a few vectorized passes over the table, about 1 ms for 1,000 slabs x 4,096 blocks.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from fineslab.errors import IntegrityError
from fineslab.slabs.table import NO_OWNER, PADDING_SLAB, POOLED, SlabState, SlabTable


@dataclass(frozen=True)
class OwnerUsage:
    runtime_id: str
    pid: int
    alive: bool
    key: int
    num_slabs: int  # slabs holding its blocks (a POOLED slab counts for each of its runtimes)
    used_blocks: int
    free_blocks: int  # free blocks it can take without carving: its slabs', or its key pool's
    pooled: bool = False
    kv_limit_bytes: int | None = None  # `fineslab ctl limit`; None: uncapped
    lent_slabs: int = 0  # FREE slabs holding its evicted prefix pages (lent.py)
    #: Its blocks in the padding slab (slab 0: parked, never KV), which its limit does not count.
    padding_blocks: int = 0

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.key

    def limit_blocks(self, slab_bytes: int) -> int | None:
        """The blocks of KV its limit lets it hold (whole slabs, or blocks of a key pool; the
        padding slab's come on top), None without a limit: what its allocator enforces."""
        if self.kv_limit_bytes is None:
            return None
        if self.pooled:
            return self.kv_limit_bytes // self.key
        return self.kv_limit_bytes // slab_bytes * (slab_bytes // self.key)

    def available_blocks(self, free_slabs: int, slab_bytes: int) -> int:
        """Blocks it could take now: its free blocks (its slabs', or its key pool's) and the
        free slabs' worth, within its KV limit (what its allocator's `available_blocks` says)."""
        blocks_per_slab = slab_bytes // self.key
        if self.kv_limit_bytes is None:
            return self.free_blocks + free_slabs * blocks_per_slab
        if self.pooled:
            room = max(0, self.kv_limit_bytes // self.key - self.used_blocks
                       + self.padding_blocks)
            return min(self.free_blocks + free_slabs * blocks_per_slab, room)
        counted = self.num_slabs - (1 if self.padding_blocks else 0)
        room_slabs = max(0, self.kv_limit_bytes // slab_bytes - counted)
        return self.free_blocks + min(free_slabs, room_slabs) * blocks_per_slab


@dataclass(frozen=True)
class TableSnapshot:
    """A lock-free reading of the table (exact for quiescent runtimes)."""

    slab_bytes: int
    num_slabs: int
    slabs_by_key_state: dict[tuple[int, str], int]
    owners: tuple[OwnerUsage, ...]
    padding_slab_free: bool = False

    @property
    def free_slabs(self) -> int:
        return sum(c for (_, state), c in self.slabs_by_key_state.items() if state == "FREE")

    @property
    def kv_free_slabs(self) -> int:
        """Free slabs a runtime can fill with KV: a free padding slab (slab 0) does not count,
        as the runtime that draws it parks it whole (`SlabAllocator.available_size`)."""
        return self.free_slabs - int(self.padding_slab_free)

    @property
    def free_bytes(self) -> int:
        return self.free_slabs * self.slab_bytes

    @property
    def lent_by_runtime(self) -> dict[str, int]:
        """Runtime id -> free slabs holding its lent prefix pages, for those holding any."""
        return {o.runtime_id: o.lent_slabs for o in self.owners if o.lent_slabs}


def _fail(rule: str, mask: np.ndarray) -> None:
    slabs = np.flatnonzero(mask)
    if slabs.size:
        raise IntegrityError(f"slab table breaks {rule} at slab(s) {slabs[:16].tolist()}")


def _check_free_slabs(table: SlabTable) -> None:
    free = table.state == SlabState.FREE
    _fail("T0: unknown state", table.state > SlabState.FULL)
    _fail("T1: FREE <=> no owner", free != (table.owner == NO_OWNER))
    _fail("T1: FREE slab with key/used/free blocks",
          free & ((table.key != 0) | (table.used != 0) | table.free_map.any(axis=1)))
    _fail("T6: block owners outside a POOLED slab",
          (table.owner != POOLED) & table.block_owner.any(axis=1))
    marks = table.lent_to.astype(np.int64)
    borrowers = np.clip(marks - 1, 0, table.dims.max_runtimes - 1)
    _fail("T7: a lent slab not FREE or lent to no active runtime",
          (marks != 0) & (~free | (table.rt_status[borrowers] != 1)))
    _fail("T7: a copy running into a slab that is not lent", (table.lent_busy != 0) & (marks == 0))


def _check_owned_slabs(table: SlabTable) -> np.ndarray:
    owned = table.state != SlabState.FREE
    pooled = table.owner == POOLED
    key = np.where(owned, table.key, table.dims.slab_bytes)
    _fail("T2: key does not divide the slab", owned & ((key <= 0) | (table.dims.slab_bytes %
                                                                     np.maximum(key, 1) != 0)))
    _check_pooled_owners(table, owned & pooled)
    owned = owned & ~pooled
    max_slot = table.dims.max_runtimes - 1
    slots = np.clip(table.owner, 0, max_slot)
    _fail("T2: owner out of range", owned & (slots != table.owner))
    _fail("T2: owner not an active runtime", owned & (table.rt_status[slots] != 1))
    _fail("T2: key differs from the owner's", owned & (table.rt_key[slots] != table.key))
    return owned


def _check_pooled_owners(table: SlabTable, pooled: np.ndarray) -> None:
    """T6: each block of a POOLED slab is free or held by an active pooled runtime of its key."""
    rows = np.flatnonzero(pooled)
    if rows.size == 0:
        return
    marks = table.block_owner[rows].astype(np.int64)
    bps = table.dims.slab_bytes // table.key[rows]
    inside = np.arange(table.dims.max_blocks_per_slab)[None, :] < bps[:, None]
    mask = np.zeros(pooled.shape, dtype=bool)
    mask[rows] = ((marks != 0) & ~inside).any(axis=1)
    _fail("T6: a block owner beyond bps", mask)
    mask[rows] = (((marks == 0) != (table.free_map[rows] == 1)) & inside).any(axis=1)
    _fail("T6: free map and block owners disagree", mask)
    slots = np.clip(marks - 1, 0, table.dims.max_runtimes - 1)
    good = (marks - 1 == slots) & (table.rt_status[slots] == 1) & (table.rt_pooled[slots] == 1) \
        & (table.rt_key[slots] == table.key[rows][:, None])
    mask[rows] = ((marks != 0) & ~good).any(axis=1)
    _fail("T6: a block held by no active pooled runtime of the slab's key", mask)


def _check_counts(table: SlabTable, exact: np.ndarray) -> None:
    rows = np.flatnonzero(exact)
    if rows.size == 0:
        return
    bps = table.dims.slab_bytes // table.key[rows]
    free_rows = table.free_map[rows]
    inside = np.arange(table.dims.max_blocks_per_slab)[None, :] < bps[:, None]
    mask = np.zeros_like(exact)
    mask[rows] = (free_rows > 1).any(axis=1) | (free_rows * ~inside).any(axis=1)
    _fail("T3: free map value not 0/1, or a free block beyond bps", mask)
    used = table.used[rows].astype(np.int64)
    mask[rows] = used + free_rows.sum(axis=1, dtype=np.int64) != bps
    _fail("T3: used + free != blocks per slab", mask)
    mask[rows] = (used <= 0) | (used > bps)
    _fail("T4: owned slab empty (not returned) or over-full", mask)
    mask[rows] = (table.state[rows] == SlabState.FULL) != (used == bps)
    _fail("T4: FULL <=> used == bps", mask)


def _check_registry(table: SlabTable) -> None:
    names = list(table.active_runtimes().values())
    if len(names) != len(set(names)):
        raise IntegrityError(f"slab table breaks T5: duplicate runtime ids in {names}")
    if table.writable and table.lock_holder_pid != table.me.pid:
        raise IntegrityError("slab table breaks T5: lock holder field is not ours under lock")
    limits = table.kv_limits()
    for slot, name in table.active_runtimes().items():
        if table.kv_limit(slot) != limits.get(name):
            raise IntegrityError(f"slab table breaks the KV limit invariant (limits.py): slot "
                                 f"{slot} ({name}) has {table.kv_limit(slot)}, its id "
                                 f"{limits.get(name)}")


def check_integrity(table: SlabTable, exact_owners: Collection[int] | None = None) -> None:
    """Verify T1-T5; T3/T4 for slabs of `exact_owners` (registry slots; None = every owner).

    Raises IntegrityError naming the rule and the slabs that break it.
    """
    with table.lock():
        _check_free_slabs(table)
        owned = _check_owned_slabs(table)
        exact = owned.copy()
        if exact_owners is not None:
            exact &= np.isin(table.owner, np.asarray(list(exact_owners), dtype=np.int32))
        exact |= (table.owner == POOLED) & (table.state != SlabState.FREE)
        _check_counts(table, exact)
        _check_registry(table)


def snapshot(table: SlabTable) -> TableSnapshot:
    """Slabs per (key, state) and usage per owner, read without the lock."""
    state, key, owner = table.state.copy(), table.key.copy(), table.owner.copy()
    used = table.used.astype(np.int64)
    counts: dict[tuple[int, str], int] = {}
    for slab_key, slab_state in zip(key.tolist(), state.tolist(), strict=True):
        label = (slab_key, SlabState(slab_state).name)
        counts[label] = counts.get(label, 0) + 1
    owners = []
    partial = state == SlabState.PARTIAL
    bps = np.where(key > 0, table.dims.slab_bytes // np.maximum(key, 1), 0)
    pool_marks = table.block_owner[owner == POOLED]  # only POOLED rows hold block owners
    marks = table.lent_to[state == SlabState.FREE].astype(np.int64)
    lent = np.bincount(marks, minlength=table.dims.max_runtimes + 1)
    for slot, name in sorted(table.active_runtimes().items()):
        identity = table.identity_of(slot)
        slot_key = int(table.rt_key[slot])
        if table.rt_pooled[slot]:
            held = pool_marks == slot + 1
            num_slabs, used_blocks = int(held.any(axis=1).sum()), int(held.sum())
            pool = partial & (owner == POOLED) & (key == slot_key)
            free_blocks = int((bps[pool] - used[pool]).sum())
            padding = int(np.count_nonzero(table.block_owner[PADDING_SLAB] == slot + 1)) \
                if owner[PADDING_SLAB] == POOLED else 0
        else:
            mine = owner == slot
            num_slabs, used_blocks = int(mine.sum()), int(used[mine].sum())
            free_blocks = int((bps[mine] - used[mine]).sum())
            padding = int(used[PADDING_SLAB]) if owner[PADDING_SLAB] == slot else 0
        owners.append(OwnerUsage(name, identity.pid, identity.is_alive(), slot_key, num_slabs,
                                 used_blocks, free_blocks, bool(table.rt_pooled[slot]),
                                 table.kv_limit(slot), int(lent[slot + 1]), padding))
    return TableSnapshot(table.dims.slab_bytes, table.dims.num_slabs, counts, tuple(owners),
                         bool(state[PADDING_SLAB] == SlabState.FREE))

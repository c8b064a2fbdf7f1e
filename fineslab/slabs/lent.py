"""LentPages: a borrower's evicted prefix pages kept in free slabs of its arena (SwiftCache).

When a runtime's radix cache evicts a prefix, its pages are copied here, into FREE slabs of the
same arena that the table marks as lent to it (`table.py`, "lent slab"), and indexed by a hash of
the whole prefix up to each page; the next request with that prefix copies them back instead of
recomputing them (`sglang_plugin/prefix_tier.py`). A lent slab stays FREE: every runtime counts
it as free and any carve takes it at once, dropping its pages (never moving them), so a lender's
own allocation never waits for a borrower.

Glossary
    page        one block of the borrower's format: `block_stride` bytes, all layers' K and V of
                `tokens_per_block` tokens, one row of `pages` (row p = block id p of the format)
    entry       one lent page: hash -> (slab, block in slab, lent_gen of the slab when written)
    held        lent slabs this borrower took and has not seen taken back, with their free
                blocks; at most the table's `rt_lend_cap[slot]` of them
    valid       an entry whose slab still has lent_to == slot + 1 and the recorded lent_gen

Concurrency (the table lock is the only lock)
    write   a slab at a time: under the lock, check its mark and gen and raise its busy flag
            (`lent_busy`); copy without the lock; lower the flag. A carve takes a busy slab
            last, and only after the flag is down (table.py, `_wait_copies_locked`), so a
            borrower never writes into a slab a lender took, the lock is never held for a copy,
            and a carve waits for a copy only when it needs that very slab (one slab's bytes)
    read    without the lock, seqlock-style: check, copy, check again; a page whose slab was
            taken meanwhile reads as a miss (the caller recomputes). On CPU (x86 TSO) a lender's
            writes follow its carve's gen bump, so a copy that saw any of them sees the bump at
            the second check. A GPU copy would need a fence before the second check.

Invariants
    every entry's block lies in a held slab, blocks of held slabs are free xor in one entry
    len(held) <= rt_lend_cap[slot] after every `store` (the launcher may lower the cap and drop
    marks itself; the borrower notices at its next store or lookup)

Cost: a store or a load is one vectorized row copy per slab touched (`index_copy_`); the index is
a dict, LRU-ordered, and the slabs' marks are read from the table's numpy arrays.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fineslab.slabs.table import PADDING_SLAB, SlabState, SlabTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Entry:
    slab: int
    block: int
    gen: int


@dataclass
class LentStats:
    """Counters since start, for a debugger and the tests (not exported yet)."""

    stored_pages: int = 0
    loaded_pages: int = 0
    dropped_pages: int = 0  # entries found invalid (their slab was taken back)
    refused_pages: int = 0  # pages a store had no room for (no free slab within the cap)


class LentPages:
    """One borrower's lent tier over its arena's free slabs."""

    def __init__(self, table: SlabTable, slot: int, pages: torch.Tensor,
                 blocks_per_slab: int) -> None:
        self.table, self.slot, self.pages = table, slot, pages
        self.bps = blocks_per_slab
        self.mark = slot + 1
        self.index: OrderedDict[bytes, _Entry] = OrderedDict()
        self.held: dict[int, tuple[int, list[int]]] = {}  # slab -> (gen, free blocks)
        self.stats = LentStats()

    # -- validity ---------------------------------------------------------------------------
    def _alive(self, slab: int, gen: int) -> bool:
        return bool(self.table.lent_to[slab] == self.mark and self.table.lent_gen[slab] == gen)

    def _forget_taken(self) -> None:
        """Drop held slabs a carve (or the launcher) took back, and their entries."""
        taken = {s for s, (gen, _) in self.held.items() if not self._alive(s, gen)}
        if not taken:
            return
        for slab in taken:
            del self.held[slab]
        stale = [h for h, e in self.index.items() if e.slab in taken]
        for h in stale:
            del self.index[h]
        self.stats.dropped_pages += len(stale)

    @property
    def cap(self) -> int:
        return int(self.table.rt_lend_cap[self.slot])

    # -- store ------------------------------------------------------------------------------
    def store(self, hashes: Sequence[bytes], page_ids: Sequence[int]) -> int:
        """Copy pages `page_ids` of the borrower's own KV in under `hashes` (one per page);
        returns how many were stored. Pages already lent are refreshed in the LRU order only."""
        fresh = [(h, p) for h, p in zip(hashes, page_ids, strict=True) if h not in self.index]
        for h in hashes:
            if h in self.index:
                self.index.move_to_end(h)
        if not fresh:
            return 0
        with self.table.lock():
            self._forget_taken()
            self._fit_cap_locked()
            self._grow_locked(len(fresh))
            placed = self._place(len(fresh))
        by_slab: dict[int, list[tuple[bytes, int, int]]] = {}
        for (h, page), (slab, block) in zip(fresh, placed, strict=False):
            by_slab.setdefault(slab, []).append((h, page, block))
        stored = 0
        for slab, items in by_slab.items():
            with self.table.lock():  # still ours? then the busy flag keeps carves off it
                gen = self.held.get(slab, (-1, []))[0]
                if not self._alive(slab, gen):
                    continue  # taken since it was planned: those pages are not lent
                self.table.lent_busy[slab] = 1
            try:
                dst = torch.tensor([slab * self.bps + b for _, _, b in items], dtype=torch.long)
                src = torch.tensor([p for _, p, _ in items], dtype=torch.long)
                self.pages.index_copy_(0, dst.to(self.pages.device),
                                       self.pages.index_select(0, src.to(self.pages.device)))
            finally:
                self.table.lent_busy[slab] = 0
            for h, _, block in items:
                self.index[h] = _Entry(slab, block, gen)
            stored += len(items)
        self.stats.stored_pages += stored
        self.stats.refused_pages += len(fresh) - stored
        return stored

    def _fit_cap_locked(self) -> None:
        """Give back held slabs beyond the cap (the emptiest first)."""
        excess = len(self.held) - self.cap
        if excess <= 0:
            return
        victims = sorted(self.held, key=lambda s: -len(self.held[s][1]))[:excess]
        self.table.drop_lent_locked(np.array(victims, dtype=np.int64))
        self._forget_taken()

    def _grow_locked(self, wanted_pages: int) -> None:
        """Take FREE, unlent slabs (highest ids first: carves take the lowest) up to the cap."""
        free_now = sum(len(blocks) for _, blocks in self.held.values())
        want = min(-(-max(0, wanted_pages - free_now) // self.bps), self.cap - len(self.held))
        if want <= 0:
            return
        t = self.table
        candidates = np.flatnonzero((t.state == SlabState.FREE) & (t.lent_to == 0))
        candidates = candidates[candidates != PADDING_SLAB][::-1][:want]
        if candidates.size:
            t.lent_to[candidates] = self.mark
            t.lent_gen[candidates] += 1
        for slab in candidates.tolist():
            self.held[slab] = (int(t.lent_gen[slab]), list(range(self.bps)))

    def _place(self, count: int) -> list[tuple[int, int]]:
        """Blocks for `count` pages: free blocks of held slabs, then the least recently used
        entries' blocks (the tier's own LRU)."""
        placed: list[tuple[int, int]] = []
        for slab, (_, blocks) in self.held.items():
            while blocks and len(placed) < count:
                placed.append((slab, blocks.pop()))
        while len(placed) < count and self.index:
            _, old = self.index.popitem(last=False)
            placed.append((old.slab, old.block))
        return placed

    # -- lookup and load --------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are lent and valid (no copy, no lock)."""
        count = 0
        for h in hashes:
            entry = self.index.get(h)
            if entry is None or not self._alive(entry.slab, entry.gen):
                break
            count += 1
        return count

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark `hashes` most recently used (a hit about to be loaded is not recycled first)."""
        for h in hashes:
            if h in self.index:
                self.index.move_to_end(h)

    def load(self, hashes: Sequence[bytes], page_ids: Sequence[int]) -> bool:
        """Copy the pages under `hashes` into the borrower's pages `page_ids`; True if every one
        was still valid after the copy (else the caller must not use any of them)."""
        entries = [self.index.get(h) for h in hashes]
        if any(e is None or not self._alive(e.slab, e.gen) for e in entries):
            return False
        valid = [e for e in entries if e is not None]
        src = torch.tensor([e.slab * self.bps + e.block for e in valid], dtype=torch.long)
        dst = torch.tensor(list(page_ids), dtype=torch.long)
        self.pages.index_copy_(0, dst.to(self.pages.device),
                               self.pages.index_select(0, src.to(self.pages.device)))
        if not all(self._alive(e.slab, e.gen) for e in valid):
            return False
        for h in hashes:
            self.index.move_to_end(h)
        self.stats.loaded_pages += len(valid)
        return True

    # -- lifetime ---------------------------------------------------------------------------
    def held_slabs(self) -> int:
        return len(self.held)

    def release(self) -> None:
        """Give every lent slab back (the borrower stops; a dead one's marks go with its slot)."""
        with self.table.lock():
            mine = np.flatnonzero(self.table.lent_to == self.mark)
            self.table.drop_lent_locked(mine)
        self.held.clear()
        self.index.clear()


def set_lend_cap(table: SlabTable, runtime_id: str, slabs: int) -> bool:
    """Let `runtime_id` hold up to `slabs` lent slabs (0: lending off); False if it is not
    attached. A lower cap takes effect at the borrower's next store, and a carve takes any lent
    slab at once meanwhile, so nobody waits for a borrower to shrink."""
    with table.lock():
        for slot, name in table.active_runtimes().items():
            if name == runtime_id:
                table.rt_lend_cap[slot] = max(0, int(slabs))
                return True
    return False


def lent_slabs(table: SlabTable) -> dict[str, int]:
    """Runtime id -> slabs it holds lent now (lock-free read)."""
    from fineslab.slabs.integrity import snapshot

    return snapshot(table).lent_by_runtime

"""SwiftCache's lending policy in a launched fleet: how many slabs each borrower may hold lent.

A model with `prefix_lending` (a borrower) keeps the pages its radix cache evicts in free slabs
of its device's arena (`fineslab.slabs.lent`, `sglang_plugin/prefix_tier.py`). This round sets,
every INTERVAL_S per device, the most slabs each borrower may hold (`rt_lend_cap`):

    lenders     every other runtime on the device; each has an `ElasticAllocation` (Algorithm
                1, `fineslab.scheduler.swiftcache`) over its demand D_i = slabs it holds now,
                with K_i = the arena's slabs and an elastic unit of one slab: N_i jumps at once
                to any D_i above it and shrinks every `check_s` to the largest D_i of the last
                `window_s`; its headroom N_i - D_i is left free for its next burst
    budget      per borrower: lend_budget(free unlent slabs / borrowers, headrooms, its lent
                slabs, cap = `cap` x arena slabs, low water = the cache reclaimer's), so the
                borrowers of a device split what the lenders do not keep
    fairness    an idle model's own cached pages already yield to a busy neighbour before any
                request is refused (the cache reclaimer, `reclaim.py`), and lent pages yield
                before either: a lent slab is FREE, and every carve takes it at once (dropped,
                never moved), whatever the cap says

A lower cap takes effect at the borrower's next store (`LentPages._fit_cap_locked`); a carve
needs no cap change to take a lent slab. Decisions are logged at debug level when they change,
and the lent slabs per runtime show in `/metrics` (`fineslab_slab_owner_lent_slabs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fineslab.fleet.rounds import Rounds
from fineslab.scheduler.reclaim import ReclaimConfig
from fineslab.scheduler.swiftcache import ElasticAllocation, lend_budget
from fineslab.slabs.integrity import snapshot
from fineslab.slabs.lent import set_lend_cap
from fineslab.slabs.table import SlabTable

logger = logging.getLogger(__name__)

#: The cache reclaimer's low-water mark (fineslab.scheduler.reclaim), which this loop keeps free.
LOW_FREE_FRACTION = ReclaimConfig().low_free_fraction

INTERVAL_S = 0.5


@dataclass(frozen=True)
class BorrowerSpec:
    runtime_id: str
    device: str
    cap: float  # of the arena's slabs
    window_s: float
    check_s: float


class PrefixLending(Rounds):
    """The round of the module docstring, over each device's slab table."""

    def __init__(self, borrowers: Sequence[BorrowerSpec], devices: Mapping[str, Sequence[str]],
                 table_of: Callable[[str], SlabTable | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("prefix-lending", INTERVAL_S)
        self.borrowers = {b.runtime_id: b for b in borrowers}
        self.devices = devices  # device -> every runtime id there
        self._table_of, self._clock = table_of, clock
        self._lenders: dict[str, ElasticAllocation] = {}
        self.caps: dict[str, int] = {}

    def run_once(self) -> dict[str, int]:
        """One round; returns each borrower's cap (slabs)."""
        now = self._clock()
        for device, runtime_ids in self.devices.items():
            mine = [self.borrowers[r] for r in runtime_ids if r in self.borrowers]
            table = self._table_of(device)
            if not mine or table is None:
                continue
            snap = snapshot(table)
            held = {o.runtime_id: o.num_slabs for o in snap.owners if o.alive}
            lent = snap.lent_by_runtime
            headrooms = []
            for runtime_id in runtime_ids:
                if runtime_id in self.borrowers or runtime_id not in held:
                    continue
                lender = self._lenders.setdefault(runtime_id, ElasticAllocation(
                    snap.num_slabs, 1, max(b.window_s for b in mine),
                    min(b.check_s for b in mine)))
                lender.observe(now, held[runtime_id])
                headrooms.append(lender.headroom(held[runtime_id]))
            free_unlent = max(0, snap.free_slabs - sum(lent.values()))
            low_water = int(LOW_FREE_FRACTION * snap.num_slabs)
            for borrower in mine:
                cap = lend_budget(free_unlent // len(mine), headrooms,
                                  lent.get(borrower.runtime_id, 0),
                                  int(borrower.cap * snap.num_slabs), low_water)
                if self.caps.get(borrower.runtime_id) != cap:
                    logger.debug("prefix lending: %s may hold %d lent slab(s) on %s (free %d, "
                                 "lenders' headroom %d)", borrower.runtime_id, cap, device,
                                 free_unlent, sum(headrooms))
                if set_lend_cap(table, borrower.runtime_id, cap):
                    self.caps[borrower.runtime_id] = cap
        return dict(self.caps)


def start_prefix_lending(borrowers: Sequence[BorrowerSpec],
                         devices: Mapping[str, Sequence[str]],
                         table_of: Callable[[str], SlabTable | None]) -> PrefixLending | None:
    """The round, started; None without borrowers."""
    if not borrowers:
        return None
    lending = PrefixLending(borrowers, devices, table_of)
    lending.run_once()
    lending.start()
    return lending

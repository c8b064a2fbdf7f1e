"""SwiftCache's lending in a launched fleet: how many slabs each borrower may hold lent.

A model with `prefix_lending` (a borrower) keeps the pages its radix cache evicts in free slabs
of its device's arena (`fineslab.slabs.lent`, `sglang_plugin/prefix_tier.py`). Every INTERVAL_S,
per device with a borrower, this loop snapshots the slab table, asks the policy
(`fineslab.scheduler.swiftcache.PrefixLendPolicy`: Algorithm 1 per lender, `lend_budget` per
borrower) for each borrower's cap, and writes it (`rt_lend_cap`).

Fairness: an idle model's own cached pages already yield to a busy neighbour before any
request is refused (the cache reclaimer), and lent pages yield before either: a lent slab is
FREE, and every carve takes it at once (dropped, never moved), whatever the cap says. A lower
cap takes effect at the borrower's next store (`LentPages._fit_cap_locked`). Decisions are
logged at debug level when they change, and the lent slabs per runtime show in `/metrics`
(`fineslab_slab_owner_lent_slabs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fineslab.fleet.rounds import Rounds
from fineslab.scheduler.swiftcache import BorrowerTerms, LendingUse, PrefixLendPolicy
from fineslab.slabs.integrity import snapshot
from fineslab.slabs.lent import set_lend_cap
from fineslab.slabs.table import SlabTable

logger = logging.getLogger(__name__)

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
        self.policy = PrefixLendPolicy(
            [BorrowerTerms(b.runtime_id, b.cap, b.window_s, b.check_s) for b in borrowers])
        self.caps: dict[str, int] = {}

    def run_once(self) -> dict[str, int]:
        """One round; returns each borrower's cap (slabs)."""
        now = self._clock()
        for device, runtime_ids in self.devices.items():
            table = self._table_of(device)
            if table is None or not any(r in self.borrowers for r in runtime_ids):
                continue
            snap = snapshot(table)
            decision = self.policy.decide(LendingUse(
                device, tuple(runtime_ids), snap.num_slabs, snap.free_slabs,
                {o.runtime_id: o.num_slabs for o in snap.owners if o.alive},
                snap.lent_by_runtime), now)
            if decision is None:
                continue
            for runtime_id, cap in decision.caps.items():
                if self.caps.get(runtime_id) != cap:
                    logger.debug("prefix lending: %s may hold %d lent slab(s) on %s (%s)",
                                 runtime_id, cap, device, decision.reason)
                if set_lend_cap(table, runtime_id, cap):
                    self.caps[runtime_id] = cap
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

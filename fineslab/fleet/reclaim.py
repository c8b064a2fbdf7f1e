"""The cache reclaim loop: idle runtimes give their cached prefixes back when a neighbour needs
the arena (the rule and its thresholds: `fineslab.scheduler.reclaim`).

Every `interval_s`, per device arena: one slab-table snapshot and the router's demand make an
`ArenaUse`; the policy decides; the loop POSTs `/flush_cache` to each runtime it names. No
runtime can evict another's cache and an idle scheduler does not run, so the launcher does it
from outside. SGLang flushes only an idle runtime (it answers 400 otherwise: a request arrived
meanwhile, so nothing is lost); the flush gives every KV page back through the SlabAllocator,
whose empty slabs return to the arena at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from fineslab.fleet.rounds import Rounds
from fineslab.scheduler.reclaim import ArenaUse, CacheReclaimPolicy, ReclaimConfig
from fineslab.slabs.integrity import TableSnapshot

logger = logging.getLogger(__name__)


class CacheReclaimer(Rounds):
    """The policy's decisions applied, on a thread of its own."""

    def __init__(self, devices: Mapping[str, Sequence[str]],
                 snapshot_of: Callable[[str], TableSnapshot | None],
                 demand: Callable[[], Mapping[str, int]], url_of: Callable[[str], str],
                 clock: Callable[[], float] = time.monotonic,
                 config: ReclaimConfig | None = None) -> None:
        self.policy = CacheReclaimPolicy(config or ReclaimConfig())
        super().__init__("reclaim", self.policy.config.interval_s)
        self.devices = devices  # device -> runtime ids on it
        self._snapshot_of, self._demand, self._url_of = snapshot_of, demand, url_of
        self._clock = clock
        self.flushes = 0
        #: per device, whether the last round found it pressed, and stalled (a runtime with
        #: work held the same blocks for stall_s); the layer lender reads both
        self.pressed: dict[str, bool] = {}
        self.stalled: dict[str, bool] = {}

    def run_once(self) -> list[str]:
        """One round; returns the runtimes whose caches were flushed."""
        flushed: list[str] = []
        demand = self._demand()
        now_s = self._clock()
        for device in self.devices:
            use = self._use(device, demand)
            if use is None:
                continue
            decision = self.policy.decide(use, now_s)
            self.pressed[device] = decision.pressed
            self.stalled[device] = bool(decision.stalled)
            for runtime_id in decision.flush:
                if self._flush(runtime_id):
                    flushed.append(runtime_id)
                    logger.info("flushed the prefix cache of idle %s (%d blocks): %s",
                                runtime_id, use.used_blocks[runtime_id], decision.reason)
        self.flushes += len(flushed)
        return flushed

    def flush_idle(self, device: str, exclude: str = "") -> list[str]:
        """Flush now, whatever the gap, every runtime on `device` (but `exclude`) that has no
        work and holds blocks; returns those flushed. For a restart whose weights need room:
        a runtime starting up has no requests, so the round's rule never sees it pressed."""
        use = self._use(device, self._demand())
        if use is None:
            return []
        flushed = [r for r in self.policy.flush_all_idle(use, self._clock(), exclude)
                   if self._flush(r)]
        now_s = self._clock()
        for runtime_id in flushed:
            self.policy.flushed(runtime_id, now_s)
        self.flushes += len(flushed)
        return flushed

    def _use(self, device: str, demand: Mapping[str, int]) -> ArenaUse | None:
        snap = self._snapshot_of(device)
        if snap is None:
            return None
        return ArenaUse(device, tuple(self.devices.get(device, ())), snap.free_slabs,
                        snap.num_slabs, {o.runtime_id: o.used_blocks for o in snap.owners
                                         if o.alive}, demand)

    def _flush(self, runtime_id: str) -> bool:
        try:
            reply = httpx.post(self._url_of(runtime_id) + "/flush_cache", timeout=10)
        except httpx.HTTPError as exc:
            logger.debug("flush of %s failed: %s", runtime_id, exc)
            return False
        return reply.status_code == 200

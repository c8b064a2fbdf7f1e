"""Idle runtimes give their cached prefixes back when a neighbour needs the arena.

SGLang keeps a finished request's KV in its prefix (radix) cache and frees it only to make room
for its own requests. In a shared arena that wedges a fleet: a runtime that served a burst and
went idle keeps every slab its cache holds, and a neighbour whose next request needs more
blocks than it has waits for ever (found by the long fuzz run against the demo fleet: one idle
model held 49 of 56 slabs, another's request hung with 8 free blocks). No runtime can evict
another's cache, and an idle scheduler does not run, so the launcher does it from outside:

    every INTERVAL_S, per device arena, the runtimes with work (requests in flight or queued
    in the router) are "pressed" when
        free slabs < LOW_FREE_FRACTION of the arena, or
        one of them has held the same number of blocks for STALL_S (a request waiting for
        memory: prefill and decode both take blocks as they go) while free slabs are fewer
        than STALL_FREE_FRACTION of the arena (a stopped runtime stalls too)
    then POST /flush_cache to each runtime there that has no work and holds blocks, at most
    once per MIN_GAP_S per runtime

The stall rule is what un-wedges the fuzz case (free slabs were not low: 3 of 56, while the
request needed 5); the low-free rule acts before a request has to wait.

SGLang flushes only an idle runtime (it answers 400 otherwise: a request arrived meanwhile, so
nothing is lost); the flush gives every KV page back through the SlabAllocator, whose empty
slabs return to the arena at once. Cost: one slab-table snapshot per device per interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from fineslab.fleet.rounds import Rounds
from fineslab.slabs.integrity import OwnerUsage, TableSnapshot

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
MIN_GAP_S = 5.0
LOW_FREE_FRACTION = 0.1
STALL_S = 3.0
#: A stall presses only while fewer than this fraction of the arena's slabs are free.
STALL_FREE_FRACTION = 0.5


class CacheReclaimer(Rounds):
    """The rule of the module docstring, on a thread of its own."""

    def __init__(self, devices: Mapping[str, Sequence[str]],
                 snapshot_of: Callable[[str], TableSnapshot | None],
                 demand: Callable[[], Mapping[str, int]], url_of: Callable[[str], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("reclaim", INTERVAL_S)
        self.devices = devices  # device -> runtime ids on it
        self._snapshot_of, self._demand, self._url_of = snapshot_of, demand, url_of
        self._clock = clock
        self._last: dict[str, float] = {}
        self._blocks: dict[str, tuple[int, float]] = {}  # runtime -> (used blocks, since)
        self.flushes = 0
        #: per device, whether the last round found it pressed, and stalled (a runtime with
        #: work held the same blocks for STALL_S); the layer lender reads both
        self.pressed: dict[str, bool] = {}
        self.stalled: dict[str, bool] = {}

    def run_once(self) -> list[str]:
        """One round; returns the runtimes whose caches were flushed."""
        flushed: list[str] = []
        demand = self._demand()
        now_s = self._clock()
        for device, runtime_ids in self.devices.items():
            snap = self._snapshot_of(device)
            if snap is None:
                continue
            owners = {o.runtime_id: o for o in snap.owners if o.alive}
            stalled = [r for r in runtime_ids if self._stalled(r, owners, demand, now_s)]
            waiting = [r for r in runtime_ids if demand.get(r, 0) > 0]
            low = snap.free_slabs < LOW_FREE_FRACTION * snap.num_slabs
            # A stall with most of the arena free is not memory: a SIGSTOPped runtime's
            # requests stay in flight and its blocks do not move (it flushed its idle
            # neighbours every 6 s with 55 of 56 slabs free, issue #35).
            short = snap.free_slabs < STALL_FREE_FRACTION * snap.num_slabs
            self.pressed[device] = bool(waiting) and (low or (bool(stalled) and short))
            self.stalled[device] = bool(stalled)
            if not self.pressed[device]:
                continue
            for runtime_id, owner in _idle_holders(runtime_ids, owners, demand):
                if now_s - self._last.get(runtime_id, -MIN_GAP_S) < MIN_GAP_S:
                    continue
                self._last[runtime_id] = now_s
                if self._flush(runtime_id):
                    flushed.append(runtime_id)
                    logger.info("flushed the prefix cache of idle %s (%d slabs) for %s: the "
                                "arena on %s had %d free slab(s)%s", runtime_id,
                                owner.num_slabs, ", ".join(waiting), device, snap.free_slabs,
                                f"; {', '.join(stalled)} stalled" if stalled else "")
        self.flushes += len(flushed)
        return flushed

    def flush_idle(self, device: str, exclude: str = "") -> list[str]:
        """Flush now, whatever the gap, every runtime on `device` (but `exclude`) that has no
        work and holds blocks; returns those flushed. For a restart whose weights need room:
        a runtime starting up has no requests, so the round's rule never sees it pressed."""
        snap = self._snapshot_of(device)
        if snap is None:
            return []
        owners = {o.runtime_id: o for o in snap.owners if o.alive}
        idle = _idle_holders(self.devices.get(device, ()), owners, self._demand())
        flushed = [r for r, _ in idle if r != exclude and self._flush(r)]
        now_s = self._clock()
        for runtime_id in flushed:
            self._last[runtime_id] = now_s
        self.flushes += len(flushed)
        return flushed

    def _stalled(self, runtime_id: str, owners: Mapping[str, OwnerUsage],
                 demand: Mapping[str, int], now_s: float) -> bool:
        """Whether the runtime has had work and the same block count for STALL_S."""
        owner = owners.get(runtime_id)
        if owner is None or demand.get(runtime_id, 0) == 0:
            self._blocks.pop(runtime_id, None)
            return False
        blocks, since_s = self._blocks.get(runtime_id, (-1, now_s))
        if blocks != owner.used_blocks:
            self._blocks[runtime_id] = (owner.used_blocks, now_s)
            return False
        return now_s - since_s >= STALL_S

    def _flush(self, runtime_id: str) -> bool:
        try:
            reply = httpx.post(self._url_of(runtime_id) + "/flush_cache", timeout=10)
        except httpx.HTTPError as exc:
            logger.debug("flush of %s failed: %s", runtime_id, exc)
            return False
        return reply.status_code == 200


def _idle_holders(runtime_ids: Sequence[str], owners: Mapping[str, OwnerUsage],
                  demand: Mapping[str, int]) -> list[tuple[str, OwnerUsage]]:
    """The runtimes of `runtime_ids` with no work that hold blocks: those a flush can empty."""
    return [(r, owners[r]) for r in runtime_ids
            if r in owners and owners[r].used_blocks > 0 and demand.get(r, 0) == 0]

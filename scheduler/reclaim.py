"""Cache reclaim: which idle runtimes give their cached prefixes back, and when.

SGLang keeps a finished request's KV in its prefix (radix) cache and frees it only for its own
requests. In a shared arena that wedges a fleet: an idle runtime keeps every slab its cache
holds while a neighbour's request waits for blocks (found by the long fuzz run against the demo
fleet: one idle model held 49 of 56 slabs, another's request hung with 8 free blocks). The
launcher's loop (`fineslab.fleet.reclaim`) snapshots each device's arena every
`interval_s`, asks this policy, and flushes what it is told to. The rule, per device:

    the runtimes with work (requests in flight or queued in the router) are "pressed" when
        free slabs < low_free_fraction of the arena, or
        one of them has held the same number of blocks for stall_s (a request waiting for
        memory: prefill and decode both take blocks as they go) while free slabs are fewer
        than stall_free_fraction of the arena (a stopped runtime stalls too, with the arena
        mostly free: that is not memory)
    then flush each runtime there that has no work and holds blocks, at most once per
    min_gap_s per runtime

The stall rule un-wedges the fuzz case (free slabs were not low: 3 of 56, while the request
needed 5); the low-free rule acts before a request has to wait. Snapshot in, decision out:
`decide` does no I/O and reads the clock it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReclaimConfig:
    """The thresholds of the rule above."""

    interval_s: float = 1.0
    min_gap_s: float = 5.0
    low_free_fraction: float = 0.1
    stall_s: float = 3.0
    stall_free_fraction: float = 0.5


@dataclass(frozen=True)
class ArenaUse:
    """One device's arena as the policy sees it: its slabs, the blocks each live runtime on it
    holds, and each runtime's work (requests in flight or queued)."""

    device: str
    runtime_ids: Sequence[str]
    free_slabs: int
    num_slabs: int
    used_blocks: Mapping[str, int]
    demand: Mapping[str, int]

    def idle_holders(self) -> list[str]:
        """The runtimes with no work that hold blocks: those a flush can empty."""
        return [r for r in self.runtime_ids
                if self.used_blocks.get(r, 0) > 0 and self.demand.get(r, 0) == 0]


@dataclass(frozen=True)
class ReclaimDecision:
    """What to do on one device this round, and why."""

    device: str
    pressed: bool
    stalled: tuple[str, ...]
    flush: tuple[str, ...]
    reason: str


@dataclass
class CacheReclaimPolicy:
    """The rule of the module docstring. It remembers, per runtime, when it last asked for a
    flush and since when its block count has not moved (the stall rule needs both)."""

    config: ReclaimConfig = field(default_factory=ReclaimConfig)
    _last_flush: dict[str, float] = field(default_factory=dict)
    _blocks: dict[str, tuple[int, float]] = field(default_factory=dict)

    def decide(self, use: ArenaUse, now_s: float) -> ReclaimDecision:
        cfg = self.config
        stalled = tuple(r for r in use.runtime_ids if self._stalled(r, use, now_s))
        waiting = [r for r in use.runtime_ids if use.demand.get(r, 0) > 0]
        low = use.free_slabs < cfg.low_free_fraction * use.num_slabs
        short = use.free_slabs < cfg.stall_free_fraction * use.num_slabs
        pressed = bool(waiting) and (low or (bool(stalled) and short))
        if not pressed:
            return ReclaimDecision(use.device, False, stalled, (), "not pressed")
        flush = tuple(r for r in use.idle_holders()
                      if now_s - self._last_flush.get(r, -cfg.min_gap_s) >= cfg.min_gap_s)
        for runtime_id in flush:
            self._last_flush[runtime_id] = now_s
        why = "low on free slabs" if low else "stalled"
        reason = (f"{', '.join(waiting)} waiting, the arena on {use.device} {why} "
                  f"({use.free_slabs} of {use.num_slabs} slabs free)"
                  + (f"; {', '.join(stalled)} stalled" if stalled else ""))
        return ReclaimDecision(use.device, True, stalled, flush, reason)

    def flush_all_idle(self, use: ArenaUse, now_s: float, exclude: str = "") -> tuple[str, ...]:
        """Every idle holder but `exclude`, whatever the gap (a restart whose weights need
        room: a runtime starting up has no requests, so the rule never sees it pressed)."""
        return tuple(r for r in use.idle_holders() if r != exclude)

    def flushed(self, runtime_id: str, now_s: float) -> None:
        """A flush outside `decide` happened (`flush_all_idle`): its gap starts now."""
        self._last_flush[runtime_id] = now_s

    def _stalled(self, runtime_id: str, use: ArenaUse, now_s: float) -> bool:
        """Whether the runtime has had work and the same block count for stall_s."""
        if runtime_id not in use.used_blocks or use.demand.get(runtime_id, 0) == 0:
            self._blocks.pop(runtime_id, None)
            return False
        used = use.used_blocks[runtime_id]
        blocks, since_s = self._blocks.get(runtime_id, (-1, now_s))
        if blocks != used:
            self._blocks[runtime_id] = (used, now_s)
            return False
        return now_s - since_s >= self.config.stall_s

"""Layer streaming in a launched fleet: Select-N's fixed intervals and Oneiros' lending.

A model with `layer_streaming` runs with its layers on slabs of their own (docs/streaming.md);
the launcher tells each runtime its set S of streamed layers through its stream request
(`fineslab.slabs.streamctl`, in the fleet's weights folder):

    selectn   S = the last layer of every `interval` (`offload_layers`), written before the
              runtime starts, so it streams from its first forward pass, for its whole life
    oneiros   S starts empty. Every `interval_s`, per device, the `Lender` makes a
              `DeviceLending` snapshot (the cache reclaimer's pressed and stalled verdicts,
              fleet/reclaim.py; the arena's free bytes; each oneiros runtime's stream state:
              its layers, its timed copies and decode passes; its work in the router) and asks
              `fineslab.scheduler.oneiros.LayerLendPolicy`, whose docstring has the rule and
              whose `LayerLendConfig` the thresholds: lend one more layer's worth once the
              device has been pressed for a few rounds (inactive models first, active ones
              while their copies fit their decode pass, or unbounded once the arena has
              stalled for a while), take the latest lent layer back once the arena has room
              for it above the reclaimer's low-water mark. The loop writes each runtime's new
              set S to its stream request and logs the decision.

Decisions are logged (info) and visible in `fineslab ctl list` and `/metrics` (layers lent,
bytes, bytes streamed), read from each runtime's stream state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fineslab.fleet.plan import FleetPlan, num_layers
from fineslab.fleet.rounds import Rounds
from fineslab.scheduler.oneiros import (
    DeviceLending,
    LayerLendConfig,
    LayerLendDecision,
    LayerLendPolicy,
    LenderView,
)
from fineslab.scheduler.selectn import offload_layers
from fineslab.slabs.integrity import TableSnapshot
from fineslab.slabs.streamctl import StreamState, read_state, write_request

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class LenderSpec:
    """One oneiros runtime."""

    runtime_id: str
    model: str
    device: str
    priority: int = 0
    cap: int | None = None
    slots: int = 1


def write_selectn_requests(plan: FleetPlan, folder: Path) -> None:
    """Each selectn runtime's request, before it starts."""
    for r in plan.runtimes:
        streaming = r.model.layer_streaming
        interval = streaming.layers_interval if streaming is not None else None
        if streaming is None or streaming.policy != "selectn" or interval is None:
            continue
        total = num_layers(Path(r.model_dir))
        layers = offload_layers(total, interval)
        write_request(plan.config.fleet_id, r.runtime_id, layers, streaming.slots, folder)
        logger.info("%s streams layers %s (selectn, interval %d of %d layers)", r.runtime_id,
                    layers, interval, total)


def start_lender(plan: FleetPlan, folder: Path,
                 snapshot_of: Callable[[str], TableSnapshot | None],
                 pressed: Callable[[str], bool], demand: Callable[[], Mapping[str, int]],
                 stalled: Callable[[str], bool] = lambda _device: False) -> Lender | None:
    """The lender of the fleet's oneiros runtimes, started; None when there are none."""
    specs = [LenderSpec(r.runtime_id, r.model.name, r.device.name, streaming.priority,
                        streaming.cap, streaming.slots) for r in plan.runtimes
             if (streaming := r.model.layer_streaming) is not None
             and streaming.policy == "oneiros"]
    if not specs:
        return None
    lender = Lender(plan.config.fleet_id, folder, specs, snapshot_of, pressed, demand,
                    stalled=stalled)
    lender.start()
    return lender


def stream_states(plan: FleetPlan, folder: Path) -> dict[str, StreamState]:
    """Each streaming runtime's state, by runtime id (those not yet published left out)."""
    states = {r.runtime_id: read_state(plan.config.fleet_id, r.runtime_id, folder)
              for r in plan.runtimes if r.model.layer_streaming is not None}
    return {runtime_id: s for runtime_id, s in states.items() if s is not None}


class Lender(Rounds):
    """`LayerLendPolicy`'s decisions applied, on a thread of its own (module doc)."""

    def __init__(self, fleet_id: str, folder: Path, specs: Sequence[LenderSpec],
                 snapshot_of: Callable[[str], TableSnapshot | None],
                 pressed: Callable[[str], bool], demand: Callable[[], Mapping[str, int]],
                 clock: Callable[[], float] = time.monotonic,
                 stalled: Callable[[str], bool] = lambda _device: False,
                 config: LayerLendConfig | None = None) -> None:
        self.policy = LayerLendPolicy(config)
        super().__init__("lender", self.policy.config.interval_s)
        self.fleet_id, self.folder = fleet_id, folder
        self.devices: dict[str, list[LenderSpec]] = {}
        for spec in specs:
            self.devices.setdefault(spec.device, []).append(spec)
        self._snapshot_of, self._pressed, self._demand = snapshot_of, pressed, demand
        self._stalled, self._clock = stalled, clock
        self._asked: dict[str, int] = {}  # runtime id -> seq of the request it has not answered

    def run_once(self) -> list[tuple[str, str, int]]:
        """One round; returns the changes: (runtime id, "lend" or "revert", layer)."""
        demand, now_s = self._demand(), self._clock()
        changes: list[tuple[str, str, int]] = []
        for name, specs in self.devices.items():
            snap = self._snapshot_of(name)
            if snap is None:
                continue
            states = {s.runtime_id: read_state(self.fleet_id, s.runtime_id, self.folder)
                      for s in specs}
            self._reconcile(name, states)
            pressed = self._pressed(name)
            view = DeviceLending(name, pressed, pressed and self._stalled(name),
                                 snap.free_bytes, snap.num_slabs, snap.slab_bytes,
                                 tuple(self._view(spec, states[spec.runtime_id], demand)
                                       for spec in specs
                                       if states[spec.runtime_id] is not None), now_s)
            changes += self._apply(specs, self.policy.decide(view))
        return changes

    @staticmethod
    def _view(spec: LenderSpec, state: StreamState | None, demand: Mapping[str, int]
              ) -> LenderView:
        assert state is not None
        return LenderView(spec.runtime_id, spec.priority, spec.cap,
                          demand.get(spec.runtime_id, 0) > 0, state.num_layers,
                          state.layer_bytes, state.layer_copy_s(), state.decode_compute_s,
                          state.decode_passes)

    def _reconcile(self, device: str, states: Mapping[str, StreamState | None]) -> None:
        """A runtime that answered our last request with an error streams what it says, not
        what we asked: the ledger follows it, so that a later round asks again."""
        for runtime_id, seq in list(self._asked.items()):
            state = states.get(runtime_id)
            if state is None or state.seq < seq or state.error is None:
                continue
            if self.policy.follow(device, runtime_id, state.layers):
                logger.warning("oneiros: %s streams %s, not what was asked (%s)", runtime_id,
                               sorted(state.layers), state.error)
            del self._asked[runtime_id]

    def _apply(self, specs: Sequence[LenderSpec], decision: LayerLendDecision
               ) -> list[tuple[str, str, int]]:
        for warning in decision.warnings:
            logger.warning("oneiros: %s", warning)
        for note in decision.notes:
            logger.info("oneiros: %s", note)
        changes = [(name, "lend", layer) for name, layer in decision.lend] + \
                  [(name, "revert", layer) for name, layer in decision.revert]
        ledger = self.policy.ledger(decision.device)
        for runtime_id in sorted({name for name, _, _ in changes}):
            spec = next(s for s in specs if s.runtime_id == runtime_id)
            layers = sorted(ledger.lent_of(runtime_id))
            request = write_request(self.fleet_id, runtime_id, layers, spec.slots, self.folder)
            self._asked[runtime_id] = request.seq
            done = [layer for name, _, layer in changes if name == runtime_id]
            logger.info("oneiros: %s of %s %s %s (on %s; %s); it now streams %s",
                        "layers" if len(done) > 1 else "layer", runtime_id, done,
                        "lent to the arena" if decision.lend else "taken back", spec.device,
                        decision.reason, layers or "none")
        return changes

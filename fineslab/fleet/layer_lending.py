"""Layer streaming in a launched fleet: Select-N's fixed intervals and Oneiros' lending.

A model with `layer_streaming` runs with its layers on slabs of their own (docs/streaming.md);
the launcher tells each runtime its set S of streamed layers through its stream request
(`fineslab.slabs.streamctl`, in the fleet's weights folder):

    selectn   S = the last layer of every `interval` (`offload_layers`), written before the
              runtime starts, so it streams from its first forward pass, for its whole life
    oneiros   S starts empty. Every INTERVAL_S, per device (the `Lender`):
              - pressed (the cache reclaimer's rule, fleet/reclaim.py: some runtime there has
                work and the arena is low or its blocks have stalled) for PRESSED_ROUNDS in a
                row (the reclaimer's flushes go first): lend one more layer's worth, planned by
                `fineslab.scheduler.oneiros.plan_lending` over the device's oneiros models:
                inactive ones first (no work in the router), ascending `priority`, the most
                recently used among equals, up to `cap` layers each (default half the
                layers), evenly spaced; then active models (work in the router), each
                only while the copies of its lent layers fit its decode step: T_compute is
                the decode pass each runtime times (`StreamState.decode_compute_s`), T_T a
                layer's copy as it measured it (else HOST_LINK_BYTES_S). The streamer copies
                synchronously (no copy stream yet), so nothing hides and the bound is
                `oneiros.SYNC_COPY_SHARE` of the step; a model with no timed decode pass lends
                nothing while active. Once the device has also stalled (the reclaimer's stall
                rule: a runtime with work has held the same blocks for its STALL_S) for
                STARVED_ROUNDS rounds with nothing lent, active models lend up to their caps
                whatever their copies cost, logged as a warning: a request waiting for memory
                makes no progress at all, a slower decode step some (a CI run found an active
                lender out of KV whose copies, timed on a loaded machine, never fitted a tenth
                of its pass: its requests waited for ever). The 'never a whole model' rule
                holds by `cap`
              - not pressed, and the arena has more free than the last lent layer (plus the
                reclaimer's low-water mark): that layer comes back (`plan_reversion`, the
                latest lent first)
              a model's first lent layer frees nothing net: it takes its slot buffer, which
              the plan counts

Decisions are logged (info) and visible in `fineslab ctl list` and `/metrics` (layers lent,
bytes, bytes streamed), read from each runtime's stream state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fineslab.fleet.plan import FleetPlan, num_layers
from fineslab.fleet.rounds import Rounds
from fineslab.scheduler.oneiros import (
    LendingLedger,
    LendPlan,
    ModelState,
    plan_lending,
    plan_reversion,
)
from fineslab.scheduler.reclaim import ReclaimConfig
from fineslab.scheduler.selectn import offload_layers
from fineslab.slabs.integrity import TableSnapshot
from fineslab.slabs.streamctl import StreamState, read_state, write_request

logger = logging.getLogger(__name__)

#: The cache reclaimer's low-water mark (fineslab.scheduler.reclaim), which this loop keeps free.
LOW_FREE_FRACTION = ReclaimConfig().low_free_fraction

INTERVAL_S = 0.5
PRESSED_ROUNDS = 2
#: T_T before a runtime has timed a copy of its own: CPU memcpy, about.
HOST_LINK_BYTES_S = 8 << 30
#: Decode passes a runtime must have timed before its T_compute is believed.
MIN_DECODE_PASSES = 3
#: Rounds a device must stay stalled with nothing lent before active models lend unbounded.
STARVED_ROUNDS = 4
#: The streamer copies a layer before its compute, not under it (no copy stream yet).
COPIES_OVERLAP = False


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
        if streaming is None or streaming.policy != "selectn" or streaming.interval is None:
            continue
        total = num_layers(Path(r.model_dir))
        layers = offload_layers(total, streaming.interval)
        write_request(plan.config.fleet_id, r.runtime_id, layers, streaming.slots, folder)
        logger.info("%s streams layers %s (selectn, interval %d of %d layers)", r.runtime_id,
                    layers, streaming.interval, total)


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


def _copy_s(state: StreamState | None, layer_bytes: int) -> float:
    """T_T of a runtime: a layer's copy as it timed its copies, else the host link's."""
    measured = state.layer_copy_s() if state is not None else None
    return measured if measured is not None else layer_bytes / HOST_LINK_BYTES_S


@dataclass
class _Device:
    specs: list[LenderSpec]
    pressed_rounds: int = 0
    stalled_rounds: int = 0  # rounds in a row the device stalled and nothing was lent
    ledger: LendingLedger = field(default_factory=LendingLedger)


class Lender(Rounds):
    """Oneiros' lending and reversion on a thread of its own (module doc)."""

    def __init__(self, fleet_id: str, folder: Path, specs: Sequence[LenderSpec],
                 snapshot_of: Callable[[str], TableSnapshot | None],
                 pressed: Callable[[str], bool], demand: Callable[[], Mapping[str, int]],
                 clock: Callable[[], float] = time.monotonic,
                 stalled: Callable[[str], bool] = lambda _device: False) -> None:
        super().__init__("lender", INTERVAL_S)
        self.fleet_id, self.folder = fleet_id, folder
        self.devices: dict[str, _Device] = {}
        for spec in specs:
            self.devices.setdefault(spec.device, _Device([])).specs.append(spec)
        self._snapshot_of, self._pressed, self._demand = snapshot_of, pressed, demand
        self._stalled, self._clock = stalled, clock
        self._last_used: dict[str, float] = {}
        self._asked: dict[str, int] = {}  # runtime id -> seq of the request it has not answered

    def run_once(self) -> list[tuple[str, str, int]]:
        """One round; returns the changes: (runtime id, "lend" or "revert", layer)."""
        demand, now_s = self._demand(), self._clock()
        for runtime_id, work in demand.items():
            if work > 0:
                self._last_used[runtime_id] = now_s
        changes: list[tuple[str, str, int]] = []
        for name, device in self.devices.items():
            snap = self._snapshot_of(name)
            if snap is None:
                continue
            device.pressed_rounds = device.pressed_rounds + 1 if self._pressed(name) else 0
            device.stalled_rounds = device.stalled_rounds + 1 \
                if device.pressed_rounds and self._stalled(name) else 0
            states = {s.runtime_id: read_state(self.fleet_id, s.runtime_id, self.folder)
                      for s in device.specs}
            self._reconcile(device, states)
            if device.pressed_rounds >= PRESSED_ROUNDS:
                changes += self._lend(device, states, demand)
            elif device.pressed_rounds == 0 and device.ledger.order:
                changes += self._revert(device, states, snap)
        return changes

    def _reconcile(self, device: _Device, states: Mapping[str, StreamState | None]) -> None:
        """A runtime that answered our last request with an error streams what it says, not
        what we asked: the ledger follows it, so that a later round asks again."""
        for runtime_id, seq in list(self._asked.items()):
            state = states.get(runtime_id)
            if state is None or state.seq < seq or state.error is None:
                continue
            actual = set(state.layers)
            if actual != device.ledger.lent_of(runtime_id):
                logger.warning("oneiros: %s streams %s, not what was asked (%s)", runtime_id,
                               sorted(actual), state.error)
                device.ledger.order = [(n, layer) for n, layer in device.ledger.order
                                       if n != runtime_id or layer in actual]
            del self._asked[runtime_id]

    def _models(self, device: _Device, states: Mapping[str, StreamState | None],
                demand: Mapping[str, int]) -> list[ModelState]:
        models = []
        for spec in device.specs:
            state = states.get(spec.runtime_id)
            if state is None or state.num_layers < 2:
                continue  # not up yet, or nothing it could lend and keep a layer
            cap = min(spec.cap or state.num_layers // 2, state.num_layers - 1)
            models.append(ModelState(spec.runtime_id, spec.priority,
                                     self._last_used.get(spec.runtime_id, 0.0),
                                     demand.get(spec.runtime_id, 0) > 0, state.num_layers,
                                     state.layer_bytes, device.ledger.lent_of(spec.runtime_id),
                                     max(cap, 1)))
        return models

    def _lend(self, device: _Device, states: Mapping[str, StreamState | None],
              demand: Mapping[str, int]) -> list[tuple[str, str, int]]:
        models = self._models(device, states, demand)
        if not models:
            return []
        transfer = {m.name: _copy_s(states[m.name], m.layer_bytes) for m in models}
        compute = {m.name: state.decode_compute_s for m in models
                   if (state := states[m.name]) is not None
                   and state.decode_passes >= MIN_DECODE_PASSES}
        plan = self._plan(models, transfer, compute, device, ())
        starved = device.stalled_rounds >= STARVED_ROUNDS
        unbounded = {m.name for m in models if m.active} if starved else set()
        if not plan.layers and unbounded:
            plan = self._plan(models, transfer, compute, device, unbounded)
        if not plan.layers:
            return []
        for m in models:
            if m.name in unbounded and m.name in plan.layers:
                logger.warning("oneiros: %s lends beyond its bound: the arena on %s has stalled "
                               "for %d rounds with nothing else to lend (a layer's copy %.3f ms, "
                               "its decode pass %s)", m.name, device.specs[0].device,
                               device.stalled_rounds, 1e3 * transfer[m.name],
                               f"{1e3 * compute[m.name]:.3f} ms" if m.name in compute
                               else "not timed")
            if m.active and m.name in plan.layers:
                logger.info("oneiros: %s lends while active: %d layer(s) lent, a layer's copy "
                            "%.3f ms, its decode pass %.3f ms", m.name, len(m.lent)
                            + len(plan.layers[m.name]), 1e3 * transfer[m.name],
                            1e3 * compute.get(m.name, 0.0))
        device.ledger.apply(plan)
        device.pressed_rounds = device.stalled_rounds = 0  # give the runtimes a round to use it
        return self._write(device, [(name, "lend", layer) for name, layer in plan.order])

    @staticmethod
    def _plan(models: list[ModelState], transfer: Mapping[str, float],
              compute: Mapping[str, float], device: _Device, unbounded: Collection[str]
              ) -> LendPlan:
        """One more layer's worth (the narrowest model's), counting each model's slot buffer."""
        need = min(m.layer_bytes for m in models)
        width = {m.name: m.layer_bytes for m in models}
        plan = plan_lending(models, need, transfer, compute, COPIES_OVERLAP, unbounded)
        for _ in range(len(models)):  # a model's first lent layer pays for its slot buffer
            slots = sum(width[name] for name in plan.layers if not device.ledger.lent_of(name))
            if plan.lent_bytes - slots >= need or not plan.met:
                break
            plan = plan_lending(models, need + slots, transfer, compute, COPIES_OVERLAP,
                                unbounded)
        return plan

    def _revert(self, device: _Device, states: Mapping[str, StreamState | None],
                snap: TableSnapshot) -> list[tuple[str, str, int]]:
        spare = snap.free_bytes - int(LOW_FREE_FRACTION * snap.num_slabs) * snap.slab_bytes
        sizes = {s.runtime_id: (states[s.runtime_id].layer_bytes  # type: ignore[union-attr]
                                if states.get(s.runtime_id) is not None else snap.slab_bytes)
                 for s in device.specs}
        back = plan_reversion(device.ledger.order, sizes, spare)
        if not back:
            return []
        device.ledger.revert(back)
        return self._write(device, [(name, "revert", layer) for name, layer in back])

    def _write(self, device: _Device, changes: list[tuple[str, str, int]]
               ) -> list[tuple[str, str, int]]:
        for runtime_id in sorted({name for name, _, _ in changes}):
            spec = next(s for s in device.specs if s.runtime_id == runtime_id)
            layers = sorted(device.ledger.lent_of(runtime_id))
            request = write_request(self.fleet_id, runtime_id, layers, spec.slots, self.folder)
            self._asked[runtime_id] = request.seq
            done = [layer for name, _, layer in changes if name == runtime_id]
            logger.info("oneiros: %s of %s %s %s (on %s); it now streams %s",
                        "layers" if len(done) > 1 else "layer", runtime_id,
                        done, "lent to the arena" if changes[0][1] == "lend" else "taken back",
                        spec.device, layers or "none")
        return changes

"""Oneiros policy (paper 000, sections 5.1 to 5.4): lend weight layers of models as KV cache.

When a KV allocation on a device would fail, the device's models give up the GPU memory of some
of their weight layers (the host keeps a full copy) and the KV pool grows by those bytes; a
model with lent layers streams them back over the host link at every forward pass. This module
decides only (no SGLang, no torch): which layers, how many, how they are streamed, and which
go back once the borrowed KV is empty. The mechanism (arena, the copy engine) lives elsewhere.

Glossary (one device):

    n        layers of a model (`num_layers`)
    alpha    its lent layers (`len(lent)`); their memory is KV now
    beta     GPU slots its streamed layers rotate through (1 or 2); alpha + beta layers are
             streamed per forward pass, n - alpha - beta stay resident
    T_T      seconds to copy one layer host -> GPU (`layer_bytes / link bytes/s`, profiled)
    T_c      seconds of compute of one layer in the current step (step compute / n)
    cap      most layers a model may lend (< n: an inactive model must still cold-start its
             prefill with most of its weights resident, section 5.2)

Rules (section 5.2, and issue #17 item 2):

    order     inactive models first, by ascending priority; among equal priorities the most
              recently used first (MRU defers the reload to the model least likely to run next);
              models of one rank lend round-robin, one layer at a time
    active    an active model lends only after every inactive one reached its cap, and only
              while its copies still hide under the compute of its current decode step:
              `streaming(n, alpha, T_T, T_compute).step_s <= T_compute` (equation 4 or 5).
              Section 5.3 writes T_T * alpha <= T_compute, but a step streams alpha + beta
              layers (section 5.4), so that bound alone let a step run up to (alpha + 2) /
              alpha times its compute (bug: active lending slowed every decode step).
              Where copies cannot overlap compute (`copies_overlap=False`: the CPU streamer
              copies synchronously), nothing hides: a step lasts compute + its copies, and an
              active model lends while alpha * T_T <= SYNC_COPY_SHARE * T_compute (one slot
              streams all alpha lent layers each pass: its decode step at most that share
              longer)
    layers    evenly spaced on the layer circle (section 5.4, equations 1 to 3), keeping the
              layers already lent: each new layer is the one farthest (circularly) from those
    revert    when lent KV is empty again, layers go back in the reverse order of lending

Invariants: 0 <= alpha <= cap < n for every model; the lend order holds each (model, layer)
at most once and exactly the lent layers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from fineslab.scheduler.reclaim import ReclaimConfig

from fineslab.errors import ConfigError

#: Without overlap, the most an active model's decode step may lengthen by its copies.
SYNC_COPY_SHARE = 0.1


@dataclass(frozen=True)
class ModelState:
    """One model on the device, as the policy sees it (a snapshot)."""

    name: str
    priority: int  # lower lends first (the scheduler's order of future execution)
    last_used_s: float
    active: bool
    num_layers: int
    layer_bytes: int
    lent: frozenset[int] = frozenset()
    cap: int = 0  # most layers it may lend; 0 lends none

    def __post_init__(self) -> None:
        if self.num_layers < 2 or self.layer_bytes < 1:
            raise ConfigError(f"{self.name}: needs >= 2 layers of >= 1 B")
        if not 0 <= self.cap < self.num_layers:
            raise ConfigError(f"{self.name}: cap {self.cap} must be in [0, {self.num_layers})"
                              " (a model is never lent whole)")
        if len(self.lent) > self.cap or any(not 0 <= i < self.num_layers for i in self.lent):
            raise ConfigError(f"{self.name}: lent layers {sorted(self.lent)} break the cap "
                              f"{self.cap} or the range [0, {self.num_layers})")


@dataclass(frozen=True)
class LendPlan:
    """New layers to lend, by model (sorted), and the order in which they were chosen."""

    layers: dict[str, tuple[int, ...]]
    order: tuple[tuple[str, int], ...]
    lent_bytes: int
    need_bytes: int

    @property
    def met(self) -> bool:
        """True when the plan frees at least the bytes asked for."""
        return self.lent_bytes >= self.need_bytes


@dataclass(frozen=True)
class Streaming:
    """How a model with `alpha` lent layers streams: beta slots, and the step time they give."""

    beta: int
    step_s: float
    copy_chain_s: float


def cap_for(num_layers: int, layer_transfer_s: float, prefill_compute_s: float) -> int:
    """Section 5.3: an inactive model's layers must stream in behind its cold-start prefill,
    T_T * N <= T_compute(prefill); never the whole model (at most n - 1)."""
    if layer_transfer_s <= 0:
        raise ConfigError("layer_transfer_s must be positive")
    return max(0, min(num_layers - 1, math.floor(prefill_compute_s / layer_transfer_s)))


def next_even_layer(num_layers: int, taken: Iterable[int]) -> int:
    """The layer farthest, around the layer circle, from every layer in `taken` (lowest index
    among ties; layer 0 when none is taken).

    Equation 3 bounds the hidden transfer by the smallest gap k_i between streamed layers;
    placing each new layer in the middle of the widest gap keeps the gaps as even as lending
    one layer at a time allows (exactly even when the count divides n as powers of two do).
    """
    chosen = set(taken)
    if not chosen:
        return 0

    def gap(layer: int) -> int:
        return min(min(abs(layer - c), num_layers - abs(layer - c)) for c in chosen)

    free = [i for i in range(num_layers) if i not in chosen]
    if not free:
        raise ConfigError("every layer is taken")
    return max(free, key=lambda i: (gap(i), -i))


def evenly_spaced(num_layers: int, count: int, keep: Iterable[int] = ()) -> tuple[int, ...]:
    """`count` layers on the circle of `num_layers`, including `keep` (sorted).

    Nothing kept: exactly even, layer floor(i * n / count) for i < count (gaps differ by at
    most one). Some kept: the rest are added one at a time by `next_even_layer`, since a layer
    already lent stays where it is (moving it would cost a reload and a copy of its KV).
    """
    chosen = set(keep)
    if count > num_layers or count < len(chosen):
        raise ConfigError(f"cannot pick {count} of {num_layers} layers keeping {len(chosen)}")
    if not chosen:
        return tuple(i * num_layers // count for i in range(count))
    while len(chosen) < count:
        chosen.add(next_even_layer(num_layers, chosen))
    return tuple(sorted(chosen))


def _ranks(models: Sequence[ModelState]) -> list[list[ModelState]]:
    """Inactive models grouped by priority (ascending), MRU first within a group; then the
    active models as the last group."""
    inactive = sorted((m for m in models if not m.active),
                      key=lambda m: (m.priority, -m.last_used_s, m.name))
    groups: list[list[ModelState]] = []
    for m in inactive:
        if groups and groups[-1][0].priority == m.priority:
            groups[-1].append(m)
        else:
            groups.append([m])
    active = sorted((m for m in models if m.active), key=lambda m: (-m.last_used_s, m.name))
    return groups + ([active] if active else [])


def _room(m: ModelState, count: int, layer_transfer_s: Mapping[str, float],
          step_compute_s: Mapping[str, float], copies_overlap: bool = True,
          unbounded: Collection[str] = ()) -> bool:
    """May `m` lend one more layer when it has `count` lent? An active one only while the
    copies of count + 1 lent layers (and their beta slots) still hide under its compute, or,
    without overlap, take at most SYNC_COPY_SHARE of it; one in `unbounded` up to its cap."""
    if count >= m.cap:
        return False
    if not m.active or m.name in unbounded:
        return True
    compute_s = step_compute_s.get(m.name, 0.0)
    if compute_s <= 0:
        return False
    if not copies_overlap:
        return (count + 1) * layer_transfer_s[m.name] <= SYNC_COPY_SHARE * compute_s
    return streaming(m.num_layers, count + 1, layer_transfer_s[m.name],
                     compute_s).step_s <= compute_s


def plan_lending(models: Sequence[ModelState], need_bytes: int,
                 layer_transfer_s: Mapping[str, float],
                 step_compute_s: Mapping[str, float] | None = None,
                 copies_overlap: bool = True, unbounded: Collection[str] = ()) -> LendPlan:
    """The layers to lend so that `need_bytes` more KV fit (fewer when the caps run out: see
    `LendPlan.met`). `layer_transfer_s` is T_T by model; `step_compute_s` the compute time
    of the current decode step of each active model (absent: it lends nothing; section 5.3
    takes an active model's T_compute from decode, never from a prefill); `copies_overlap`
    False where a streamed layer's copy runs before its compute, not under it (module doc);
    `unbounded`: active models that lend up to their caps whatever their copies cost (not in
    the paper: a fleet whose requests have stalled for memory, where a slower decode step
    beats none; fineslab.launch.lending)."""
    compute = step_compute_s or {}
    counts = {m.name: 0 for m in models}
    turns: list[str] = []  # the round-robin order of the new layers, by model
    freed = 0
    for group in _ranks(models):
        while freed < need_bytes:
            progressed = False
            for m in group:
                if freed >= need_bytes or not _room(m, len(m.lent) + counts[m.name],
                                                    layer_transfer_s, compute, copies_overlap,
                                                    unbounded):
                    continue
                counts[m.name] += 1
                turns.append(m.name)
                freed += m.layer_bytes
                progressed = True
            if not progressed:
                break
    layers: dict[str, tuple[int, ...]] = {}
    for m in models:
        if counts[m.name]:
            spaced = evenly_spaced(m.num_layers, len(m.lent) + counts[m.name], m.lent)
            layers[m.name] = tuple(i for i in spaced if i not in m.lent)
    taken = {name: iter(ls) for name, ls in layers.items()}
    order = tuple((name, next(taken[name])) for name in turns)
    return LendPlan(layers, order, freed, need_bytes)


def plan_reversion(lend_order: Sequence[tuple[str, int]], layer_bytes: Mapping[str, int],
                   empty_bytes: int) -> tuple[tuple[str, int], ...]:
    """The lent layers that go back when `empty_bytes` of the lent KV are empty: the latest
    lent first, as many as those bytes cover whole (dynamic reversion, section 7.6.1)."""
    back: list[tuple[str, int]] = []
    left = empty_bytes
    for name, layer in reversed(lend_order):
        if layer_bytes[name] > left:
            break
        back.append((name, layer))
        left -= layer_bytes[name]
    return tuple(back)


def streaming(num_layers: int, alpha: int, layer_transfer_s: float,
              step_compute_s: float) -> Streaming:
    """Beta and the step time of a model with `alpha` lent layers (section 5.4).

    With T_c = step_compute_s / n, one shared slot (beta = 1) serialises each of the alpha + 1
    streamed layers' copy with its compute, equation 4 holding when
        T_T * (alpha + 1) <= T_c * (n - alpha - 1)                                      (4)
    and the step lasting max(n T_c, (alpha + 1)(T_T + T_c)); two slots (beta = 2, double
    buffering) let a copy run under the previous layer's compute, equation 5 holding when
        T_T * (alpha + 2) <= T_c * n                                                    (5)
    and the step lasting max(n T_c, (alpha + 2) T_T). Beta is 1 while equation 4 holds (the
    least traffic), else the beta of the shorter step (2 whenever equation 5 holds). Each
    equation holds exactly when its step time equals the compute: the copies hide.
    """
    if alpha == 0:
        return Streaming(1, step_compute_s, 0.0)
    if not 0 < alpha < num_layers:
        raise ConfigError(f"alpha {alpha} must be in [0, {num_layers})")
    t_c = step_compute_s / num_layers
    one = (alpha + 1) * (layer_transfer_s + t_c)
    two = (alpha + 2) * layer_transfer_s
    if one <= step_compute_s or one <= two:
        return Streaming(1, max(step_compute_s, one), one)
    return Streaming(2, max(step_compute_s, two), two)


@dataclass
class LendingLedger:
    """One device's lent layers in lending order (mutable; the simulator and the live
    controller keep one per device). Applies plans and reversions, and reports them."""

    order: list[tuple[str, int]] = field(default_factory=list)

    def lent_of(self, name: str) -> frozenset[int]:
        return frozenset(layer for n, layer in self.order if n == name)

    def apply(self, plan: LendPlan) -> None:
        held = set(self.order)
        if any(pair in held for pair in plan.order):
            raise ConfigError("plan lends a layer already lent")
        self.order.extend(plan.order)

    def revert(self, back: Sequence[tuple[str, int]]) -> None:
        expected = list(reversed(self.order[len(self.order) - len(back):]))
        if list(back) != expected:
            raise ConfigError("reversion must undo the latest lending first")
        del self.order[len(self.order) - len(back):]

    def with_lent(self, models: Sequence[ModelState]) -> list[ModelState]:
        """`models` with their lent sets as this ledger holds them."""
        return [replace(m, lent=self.lent_of(m.name)) for m in models]


# --- the fleet's lending loop: when to lend and when to take back ------------------------------


def _or(measured: float | None, otherwise: float) -> float:
    return otherwise if measured is None else measured


@dataclass(frozen=True)
class LayerLendConfig:
    """The thresholds of `LayerLendPolicy` (the loop that applies it:
    `fineslab.fleet.layer_lending`)."""

    #: Seconds between rounds.
    interval_s: float = 0.5
    #: Rounds in a row a device must be pressed (the cache reclaimer's rule,
    #: `fineslab.scheduler.reclaim`) before a layer is lent: the reclaimer's flushes go first.
    pressed_rounds: int = 2
    #: T_T before a runtime has timed a copy of its own (bytes/s): CPU memcpy, about.
    host_link_bytes_s: float = float(8 << 30)
    #: Decode passes a runtime must have timed before its T_compute is believed.
    min_decode_passes: int = 3
    #: Rounds a device must stay stalled with nothing lent before active models lend unbounded.
    starved_rounds: int = 4
    #: Whether a streamed layer's copy runs under compute (False: the CPU streamer copies first).
    copies_overlap: bool = False
    #: Free slabs (a fraction of the arena) kept free when layers come back: the cache
    #: reclaimer's low-water mark, so that taking a layer back never presses the device.
    low_free_fraction: float = ReclaimConfig().low_free_fraction

    def __post_init__(self) -> None:
        if min(self.interval_s, self.host_link_bytes_s) <= 0 or min(
                self.pressed_rounds, self.starved_rounds) < 1 or self.min_decode_passes < 0 \
                or not 0 <= self.low_free_fraction < 1:
            raise ConfigError(f"layer lending thresholds out of range: {self}")


@dataclass(frozen=True)
class LenderView:
    """One runtime that may lend, as this round sees it (its stream state and the router)."""

    runtime_id: str
    priority: int
    #: most layers it may lend (None: half its layers); never all of them
    cap: int | None
    #: work in the router (requests in flight or queued)
    active: bool
    num_layers: int
    layer_bytes: int
    #: a layer's copy as the runtime timed its copies (None: none timed yet)
    copy_s: float | None = None
    #: its decode pass as it timed it, and how many passes fed that
    decode_compute_s: float = 0.0
    decode_passes: int = 0


@dataclass(frozen=True)
class DeviceLending:
    """One device as `LayerLendPolicy` sees it: the reclaimer's verdicts, the arena's free
    bytes, and the runtimes up on it that may lend (one without a stream state yet is absent;
    a layer of it that comes back counts as one slab)."""

    device: str
    pressed: bool
    stalled: bool
    free_bytes: int
    num_slabs: int
    slab_bytes: int
    runtimes: tuple[LenderView, ...]
    now_s: float


@dataclass(frozen=True)
class LayerLendDecision:
    """What to do on one device this round: layers to lend or to take back (runtime id,
    layer, in order), and why; `warnings` name the runtimes lending beyond their bound."""

    device: str
    lend: tuple[tuple[str, int], ...] = ()
    revert: tuple[tuple[str, int], ...] = ()
    reason: str = ""
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass
class _DeviceRounds:
    pressed: int = 0
    stalled: int = 0  # rounds in a row the device stalled and nothing was lent
    ledger: LendingLedger = field(default_factory=LendingLedger)


class LayerLendPolicy:
    """When a device's models lend layers and when they come back (Oneiros, issue #17):

        pressed for `pressed_rounds` rounds in a row: lend one more layer's worth (the
            narrowest model's), planned by `plan_lending` over the device's models: inactive
            ones first (ascending priority, the most recently used among equals), up to their
            caps (default half the layers), evenly spaced; then active ones, each only while
            the copies of its lent layers fit its timed decode pass (`min_decode_passes`
            passes timed; T_T its timed copies, else `host_link_bytes_s`). A model's first
            lent layer frees nothing net: it takes its slot buffer, which the plan counts.
            Once the device has also stalled for `starved_rounds` rounds with nothing lent,
            active models lend up to their caps whatever their copies cost (a warning: a
            request waiting for memory makes no progress at all, a slower decode step some)
        not pressed, and the arena has more free than the last lent layer plus the
            low-water mark: that layer comes back (`plan_reversion`, the latest lent first)

    It keeps, per device, the rounds counted and the ledger of lent layers; snapshot in,
    decision out (`decide` does no I/O and reads the clock it is given)."""

    def __init__(self, config: LayerLendConfig | None = None) -> None:
        self.config = config or LayerLendConfig()
        self._devices: dict[str, _DeviceRounds] = {}
        self._last_used: dict[str, float] = {}

    def ledger(self, device: str) -> LendingLedger:
        return self._devices.setdefault(device, _DeviceRounds()).ledger

    def follow(self, device: str, runtime_id: str, streams: Collection[int]) -> bool:
        """A runtime refused what it was asked and streams `streams`: the ledger believes it
        (so that a later round asks again). True when the ledger changed."""
        ledger = self.ledger(device)
        if set(streams) == ledger.lent_of(runtime_id):
            return False
        ledger.order = [(n, layer) for n, layer in ledger.order
                        if n != runtime_id or layer in streams]
        return True

    def decide(self, view: DeviceLending) -> LayerLendDecision:
        rounds = self._devices.setdefault(view.device, _DeviceRounds())
        for runtime in view.runtimes:
            if runtime.active:
                self._last_used[runtime.runtime_id] = view.now_s
        rounds.pressed = rounds.pressed + 1 if view.pressed else 0
        rounds.stalled = rounds.stalled + 1 if rounds.pressed and view.stalled else 0
        if rounds.pressed >= self.config.pressed_rounds:
            return self._lend(view, rounds)
        if rounds.pressed == 0 and rounds.ledger.order:
            return self._revert(view, rounds)
        return LayerLendDecision(view.device, reason="pressed, waiting for the reclaimer"
                                 if rounds.pressed else "not pressed, nothing lent")

    def _lend(self, view: DeviceLending, rounds: _DeviceRounds) -> LayerLendDecision:
        cfg = self.config
        models = [ModelState(r.runtime_id, r.priority, self._last_used.get(r.runtime_id, 0.0),
                             r.active, r.num_layers, r.layer_bytes,
                             rounds.ledger.lent_of(r.runtime_id),
                             max(min(r.cap or r.num_layers // 2, r.num_layers - 1), 1))
                  for r in view.runtimes if r.num_layers >= 2]
        if not models:
            return LayerLendDecision(view.device, reason="pressed, nothing that can lend")
        by_id = {r.runtime_id: r for r in view.runtimes}
        transfer = {m.name: _or(by_id[m.name].copy_s, m.layer_bytes / cfg.host_link_bytes_s)
                    for m in models}
        compute = {m.name: by_id[m.name].decode_compute_s for m in models
                   if by_id[m.name].decode_passes >= cfg.min_decode_passes}
        plan = self._plan(models, transfer, compute, rounds.ledger, ())
        starved = rounds.stalled >= cfg.starved_rounds
        unbounded = {m.name for m in models if m.active} if starved else set()
        if not plan.layers and unbounded:
            plan = self._plan(models, transfer, compute, rounds.ledger, unbounded)
        if not plan.layers:
            return LayerLendDecision(view.device, reason="pressed, every model at its cap or "
                                     "bound")
        notes, warnings = [], []
        for m in models:
            if m.name not in plan.layers:
                continue
            timed = f"{1e3 * compute[m.name]:.3f} ms" if m.name in compute else "not timed"
            if m.name in unbounded:
                warnings.append(
                    f"{m.name} lends beyond its bound: the arena on {view.device} has stalled "
                    f"for {rounds.stalled} rounds with nothing else to lend (a layer's copy "
                    f"{1e3 * transfer[m.name]:.3f} ms, its decode pass {timed})")
            if m.active:
                notes.append(f"{m.name} lends while active: "
                             f"{len(m.lent) + len(plan.layers[m.name])} layer(s) lent, a "
                             f"layer's copy {1e3 * transfer[m.name]:.3f} ms, its decode pass "
                             f"{1e3 * compute.get(m.name, 0.0):.3f} ms")
        rounds.ledger.apply(plan)
        rounds.pressed = rounds.stalled = 0  # give the runtimes a round to use it
        return LayerLendDecision(
            view.device, lend=plan.order, notes=tuple(notes), warnings=tuple(warnings),
            reason=f"pressed for {cfg.pressed_rounds} rounds"
                   + (", stalled" if unbounded else ""))

    def _plan(self, models: list[ModelState], transfer: Mapping[str, float],
              compute: Mapping[str, float], ledger: LendingLedger, unbounded: Collection[str]
              ) -> LendPlan:
        """One more layer's worth (the narrowest model's), counting each model's slot buffer."""
        overlap = self.config.copies_overlap
        need = min(m.layer_bytes for m in models)
        width = {m.name: m.layer_bytes for m in models}
        plan = plan_lending(models, need, transfer, compute, overlap, unbounded)
        for _ in range(len(models)):  # a model's first lent layer pays for its slot buffer
            slots = sum(width[name] for name in plan.layers if not ledger.lent_of(name))
            if plan.lent_bytes - slots >= need or not plan.met:
                break
            plan = plan_lending(models, need + slots, transfer, compute, overlap, unbounded)
        return plan

    def _revert(self, view: DeviceLending, rounds: _DeviceRounds) -> LayerLendDecision:
        low_water = int(self.config.low_free_fraction * view.num_slabs) * view.slab_bytes
        spare = view.free_bytes - low_water
        sizes = {r.runtime_id: r.layer_bytes for r in view.runtimes}
        order = rounds.ledger.order
        back = plan_reversion(order, {name: sizes.get(name, view.slab_bytes)
                                      for name, _ in order}, spare)
        if not back:
            return LayerLendDecision(view.device, reason="not pressed, no room for a lent "
                                     "layer above the low-water mark")
        rounds.ledger.revert(back)
        return LayerLendDecision(view.device, revert=back,
                                 reason=f"not pressed, {spare} B free above the low-water mark")

"""Layer streaming (Oneiros, paper 000) on one GPU under temporal sharing (issue #17 item 4).

Several models live on one GPU, weights resident, each with its own KV pool (its reservation
minus its weights, as vLLM processes with a `gpu_memory_utilization` each). The GPU runs one
model at a time (temporal sharing, round-robin with a time slice): the active model serves
through a `ReplicaEngine` (the real allocator and batch policy); the others are inactive and
hold no KV. With lending on, the Oneiros policy (scheduler/oneiros.py) decides, whenever the
active model's oldest waiting request does not fit, which layers of which models become KV of
the active model, and gives them back when that KV is empty again.

    KV of model m   one slab table of (own KV + every model's lendable bytes); the slabs not
                    yet lent are held FULL by a placeholder owner, so the allocator sees only
                    own + borrowed bytes:  free + used + placeholder == num_slabs
    lend            placeholder slabs are released: floor(borrowed_bytes / slab_bytes) of them
    revert          empty lent KV (free slabs, at most the borrowed bytes) takes back whole
                    layers, latest lent first; their owners reload them over the link in the
                    background (`count * T_T`), and a step of theirs that starts before the
                    reload ends lasts at least until it does
    step time       compute (the profile) for a model with nothing lent; with alpha of its own
                    layers lent, max(compute, copy chain) by equations 4 and 5 (`streaming`)
    link            host -> GPU bytes/s per device kind (`LINK_GIB_S`); T_T = layer / link
    ledgers         one `LendingLedger` per borrower: under `preempt` a paused model keeps the
                    layers lent to it while the active one borrows others; a layer is lent to
                    one borrower at most, and each borrower gives its own back, latest first

Switching (`StreamingConfig.switch`): the active model keeps the GPU while it has work, or until
`slice_s` has passed and another model has work; then the next model in round-robin order (after
the one that last held the GPU) with work takes it. What happens to the active model's running
requests at the end of its slice is the mode:

    drain     it admits nothing more and its running requests run to their end before the GPU
              moves (a drained model holds no KV, so every layer lent to it goes back at the
              switch). Cost: a slice lasts as long as its longest request (up to 1,024 decode
              steps, 10-20 s), so every other model's queue waits that long
    preempt   the GPU moves at the first step boundary past the slice end; the running requests
              pause with their KV kept (own KV and the lent layers' KV alike: the layers stay
              lent, and their owners stream them while they run) and resume at the model's
              next slice. Cost: a paused request's next token waits for the other models'
              slices (its TBT sample includes them), and KV held by a paused model is not
              available to the active one

The Oneiros paper (section 5.2, "GPU sharing background") takes temporal sharing from prior
work ("Temporal sharing allocates the entire GPU to one model at a time") and puts the
scheduler out of its scope ("the design of the scheduler itself is beyond the scope of this
study"); section 7.2 names a "default round-robin scheduling policy" and neither section
states a slice or what a switch does to running requests. Section 7.4 writes that in temporal
sharing "KV cache may be maintained only for models actively generating output tokens, while
inactive models may not retain any", which `drain` honours and `preempt` does not, so `drain`
stays the default and `preempt` is the alternative the experiment reports beside it. The two
arms of a comparison must use the same mode. TBT samples are the gaps between a request's
consecutive tokens.
"""

from __future__ import annotations

import heapq
import logging
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fineslab.errors import ConfigError
from fineslab.loadgen.metrics import RequestOutcome
from fineslab.scheduler.local import get_batch_policy
from fineslab.scheduler.oneiros import (
    LendingLedger,
    ModelState,
    cap_for,
    plan_lending,
    plan_reversion,
    streaming,
)
from fineslab.sim.config import SimConfig
from fineslab.sim.engine import ReplicaEngine, Step
from fineslab.sim.kv import ReplicaKv, gpu_slab_plan
from fineslab.sim.simulator import FleetModel
from fineslab.slabs import RuntimeSlabs, SlabTable
from fineslab.slabs.integrity import check_integrity
from fineslab.slabs.table import TableDims
from fineslab.slabs.weights import carve_weight_slabs, release_weight_slabs
from fineslab.workload import Request

logger = logging.getLogger(__name__)

GIB = 1 << 30
#: Host -> GPU copy bandwidth by device kind, GiB/s, pinned memory, one direction: PCIe 4 x16
#: (A100) and PCIe 5 x16 (H100, H200; as `ElasticSimConfig.link_gib_s`), NVLink-C2C (GH200:
#: 450 GB/s a direction nominal, about 375 GiB/s reached by copies).
LINK_GIB_S = {"a100": 12.0, "h100": 24.0, "h200": 24.0, "gh200": 375.0}
#: What a slice end does to the active model's running requests (module docstring).
SWITCH_MODES = ("drain", "preempt")


@dataclass(frozen=True)
class StreamModel:
    """A model on the shared GPU: its profile and the bytes reserved for it (weights + KV)."""

    model: FleetModel
    reserved_bytes: int
    priority: int = 0

    @property
    def layer_bytes(self) -> int:
        return self.model.profile.weights_bytes // self.model.profile.shape.num_layers

    @property
    def own_kv_bytes(self) -> int:
        return self.reserved_bytes - self.model.profile.weights_bytes


@dataclass(frozen=True)
class StreamingConfig:
    """lending: Oneiros on or off (off: each model has its own KV only); link: a `LINK_GIB_S`
    kind; slice_s: the temporal-sharing time slice; switch: what a slice end does to the
    active model's running requests (`SWITCH_MODES`, the module docstring)."""

    lending: bool = True
    link: str = "gh200"
    slice_s: float = 2.0
    batch_policy: str = "fcfs"
    switch: str = "drain"

    def __post_init__(self) -> None:
        if self.link not in LINK_GIB_S:
            raise ConfigError(f"unknown link {self.link!r}; known: {sorted(LINK_GIB_S)}")
        if self.switch not in SWITCH_MODES:
            raise ConfigError(f"unknown switch {self.switch!r}; known: {SWITCH_MODES}")
        if self.slice_s <= 0:
            raise ConfigError("slice_s must be positive")

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / (LINK_GIB_S[self.link] * GIB)


@dataclass
class _Slot:
    """One model's mutable state: its engine, KV table and placeholder slabs."""

    spec: StreamModel
    engine: ReplicaEngine
    table: SlabTable
    holder: int  # the placeholder owner's registry slot
    placeholders: np.ndarray
    own_slabs: int
    cap: int
    reach_slabs: int  # own + what lending could ever give it: a request above never runs
    pending: list[Request] = field(default_factory=list)
    last_used_s: float = 0.0
    reload_until_s: float = 0.0
    last_token_s: dict[str, float] = field(default_factory=dict)


@dataclass
class StreamingStats:
    lend_events: int = 0
    layers_lent: int = 0
    layers_reverted: int = 0
    max_layers_lent: int = 0
    streamed_steps: int = 0
    streamed_bytes: int = 0
    steps: int = 0
    tbt_s: list[float] = field(default_factory=list)

    @property
    def streamed_bytes_per_step(self) -> float:
        return self.streamed_bytes / self.steps if self.steps else 0.0


class StreamingSimulator:
    def __init__(self, models: Sequence[StreamModel], gpu_bytes: int, config: SimConfig,
                 streaming_config: StreamingConfig) -> None:
        if sum(m.reserved_bytes for m in models) > gpu_bytes:
            raise ConfigError("the reservations exceed the GPU's memory")
        self.config, self.cfg = config, streaming_config
        self.stats = StreamingStats()
        self.folder = Path(tempfile.mkdtemp(prefix="fineslab-simstream-"))
        self.slots: dict[str, _Slot] = {}
        lendable = sum(self._cap(m) * m.layer_bytes for m in models)
        try:
            for m in models:
                others = lendable - self._cap(m) * m.layer_bytes
                self.slots[m.model.name] = self._slot(m, lendable, others)
        except BaseException:
            self.close()
            raise
        self.order = [m.model.name for m in models]
        self.ledgers = {name: LendingLedger() for name in self.order}  # by borrower
        self.active: str | None = None
        self.last_active: str | None = None  # where round-robin resumes
        self.draining = False
        self._stall_switches = 0  # switches since the last step began (guards a ping-pong)
        self.slice_start_s = 0.0
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    def _cap(self, m: StreamModel) -> int:
        prefill_s = m.model.profile.prefill_s(m.model.profile.chunk_tokens)
        return cap_for(m.model.profile.shape.num_layers, self.cfg.transfer_s(m.layer_bytes),
                       prefill_s)

    def _slot(self, m: StreamModel, lendable: int, others_lendable: int) -> _Slot:
        if m.own_kv_bytes <= 0:
            raise ConfigError(f"{m.model.name}: reservation below its weights")
        name = m.model.name
        plan = gpu_slab_plan({name: m.model.profile}, self.config.min_slab_bytes)
        own = m.own_kv_bytes // plan.slab_bytes
        extra = lendable // plan.slab_bytes if self.cfg.lending else 0
        dims = TableDims(int(own + extra), plan.slab_bytes, plan.max_blocks_per_slab,
                         max_runtimes=4)
        table = SlabTable.create(self.folder / f"{len(self.slots)}.table", dims, 0)
        holder = table.register(f"{name}:lendable"[:64], plan.slab_bytes)
        placeholders = carve_weight_slabs(table, holder, int(extra), lowest=0)
        lease = RuntimeSlabs(table, name[:64], plan.format_of(name))
        engine = ReplicaEngine(name, name, m.model.profile, (0,),
                               get_batch_policy(self.cfg.batch_policy), m.model.ttft_slo_s,
                               ReplicaKv([lease]), self.config)
        # An empty active model lends none of its own layers (no decode step to hide them
        # under), so what it can count on is its own KV plus the other models' caps.
        reach = own + (others_lendable // plan.slab_bytes if self.cfg.lending else 0)
        return _Slot(m, engine, table, holder, placeholders, int(own), self._cap(m), int(reach))

    def close(self) -> None:
        for slot in self.slots.values():
            slot.engine.kv.leases[0].close()
            slot.table.close()
        self.slots = {}
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- events -------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[RequestOutcome]:
        arrivals = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        i = 0
        while i < len(arrivals) or self._heap:
            if self._heap and (i == len(arrivals) or self._heap[0][0] <= arrivals[i].arrival_s):
                now_s, _, name = heapq.heappop(self._heap)
                self._on_step_end(self.slots[name], now_s)
            else:
                self._on_arrival(arrivals[i])
                i += 1
            if self.config.check_integrity:
                for slot in self.slots.values():
                    check_integrity(slot.table)
        outcomes = [o for s in self.slots.values() for o in s.engine.outcomes]
        for slot in self.slots.values():  # waiting for KV that no lending could give
            left = list(slot.engine.waiting.values()) + slot.pending
            outcomes += [RequestOutcome(r.request_id, r.model, r.arrival_s, r.prompt_tokens, 0,
                                        None, None, dropped="never admitted") for r in left]
        return sorted(outcomes, key=lambda o: (o.arrival_s, o.request_id))

    def _on_arrival(self, request: Request) -> None:
        slot = self.slots[request.model]
        slot.last_used_s = request.arrival_s
        if not self._within_reach(slot, request):
            return
        if self.active == request.model and not self.draining:
            slot.engine.enqueue(request)
            self._start(slot, request.arrival_s)
            return
        slot.pending.append(request)
        if self.active is None:
            self._switch(request.arrival_s)
        elif self.cfg.switch == "preempt":
            self._start(self.slots[self.active], request.arrival_s)
        elif not self.slots[self.active].engine.busy:
            self._maybe_end_slice(self.slots[self.active], request.arrival_s)

    def _within_reach(self, slot: _Slot, request: Request) -> bool:
        """Drop (False) a request larger than its model's own KV plus all that lending could
        give it. Bug guarded: with lending on, the allocator's capacity counts every lendable
        slab, so such a request was never dropped; at the head of the FCFS queue it waited
        forever and every request behind it with it (C2 on PCIe: 1 of 105 served)."""
        engine = slot.engine
        lease = engine.kv.leases[0]
        if engine.kv.blocks_for(request.prompt_tokens + request.output_tokens) \
                <= slot.reach_slabs * lease.blocks_per_slab:
            return True
        engine.outcomes.append(RequestOutcome(
            request.request_id, request.model, request.arrival_s, request.prompt_tokens, 0,
            None, None, dropped="larger than its own KV plus what lending can give",
            ttft_slo_s=slot.spec.model.ttft_slo_s))
        return False

    def _on_step_end(self, slot: _Slot, now_s: float) -> None:
        running = slot.engine.prefilling + slot.engine.decoding
        before = {r.request.request_id: r.generated_tokens for r in running}
        slot.engine.finish_step(now_s)
        for r in running:
            rid = r.request.request_id
            if r.generated_tokens > before[rid]:
                if rid in slot.last_token_s:
                    self.stats.tbt_s.append(now_s - slot.last_token_s[rid])
                slot.last_token_s[rid] = now_s
                if r.generated_tokens >= r.request.output_tokens:
                    del slot.last_token_s[rid]
        slot.last_used_s = now_s
        self._revert_empty(slot, now_s)
        self._maybe_end_slice(slot, now_s)
        self._start(slot, now_s)

    def _has_work(self, slot: _Slot) -> bool:
        return bool(slot.pending) or slot.engine.load > 0

    def _maybe_end_slice(self, slot: _Slot, now_s: float, stalled: bool = False) -> None:
        """Past its slice with another model waiting, the active model stops admitting; once
        drained (or idle) the GPU goes to the next model. Under `preempt`: past its slice,
        idle, or `stalled` (work but no step it can run, e.g. its head waits for KV that a
        paused model holds), it pauses and the GPU moves at once."""
        if self.active != slot.spec.model.name:
            return
        if self.cfg.switch == "preempt":
            self._maybe_preempt(slot, now_s, stalled)
            return
        others = any(s.pending for n, s in self.slots.items() if n != self.active)
        if not self.draining and others and (now_s - self.slice_start_s >= self.cfg.slice_s
                                             or slot.engine.load == 0):
            self.draining = True
            slot.pending = list(slot.engine.waiting.values()) + slot.pending
            slot.engine.waiting.clear()
            slot.engine.inputs_version += 1
        if slot.engine.load == 0 and not slot.engine.busy and (self.draining or others):
            self._revert_empty(slot, now_s)
            self.active = None
            self._switch(now_s)

    def _maybe_preempt(self, slot: _Slot, now_s: float, stalled: bool) -> None:
        others = any(self._has_work(s) for n, s in self.slots.items() if n != self.active)
        if not others or slot.engine.busy:
            return
        expired = now_s - self.slice_start_s >= self.cfg.slice_s
        if not (expired or stalled or slot.engine.load == 0):
            return
        if stalled:
            # Two stalled models would hand the GPU back and forth at one instant; a model
            # holding lent KV has running requests and never stalls, so this is a guard only.
            self._stall_switches += 1
            if self._stall_switches > len(self.order):
                return
        self._revert_empty(slot, now_s)  # its running requests keep theirs: a part at most
        self.active = None
        self._switch(now_s)

    def _switch(self, now_s: float) -> None:
        """Give the GPU to the next model with work, round-robin after the one that last held
        it. Bug guarded: the search began after `self.active`, which the caller had just set
        to None, so it always began at the first model; that model took the GPU back while it
        had requests and the others waited (C2's OPT-6.7b behind OPT-30b)."""
        start = self.order.index(self.last_active) + 1 if self.last_active in self.order else 0
        for k in range(len(self.order)):
            name = self.order[(start + k) % len(self.order)]
            slot = self.slots[name]
            if self._has_work(slot):
                self.active, self.last_active = name, name
                self.draining, self.slice_start_s = False, now_s
                for request in slot.pending:
                    slot.engine.enqueue(request)
                slot.pending = []
                self._start(slot, now_s)
                return

    # -- lending ------------------------------------------------------------------------------
    def _start(self, slot: _Slot, now_s: float) -> None:
        engine = slot.engine
        if engine.busy:
            return
        step = engine.plan_step(now_s)
        if self.cfg.lending and self._lend_for_head(slot, now_s, step):
            engine.inputs_version += 1
            step = engine.plan_step(now_s)
        if step is None:
            if engine.load == 0:
                self._maybe_end_slice(slot, now_s)
            elif self.cfg.switch == "preempt":
                self._maybe_end_slice(slot, now_s, stalled=True)
            return
        engine.step = step
        self._push(now_s + self._step_s(slot, step, now_s), slot.spec.model.name)

    def _lend_for_head(self, slot: _Slot, now_s: float, step: Step | None) -> bool:
        """Lend layers when the oldest waiting request does not fit; True when some were."""
        engine = slot.engine
        room = self.config.max_running_requests - len(engine.prefilling) - len(engine.decoding)
        if not engine.waiting or room < 1:
            return False
        head = next(iter(engine.waiting.values()))
        lease = engine.kv.leases[0]
        short = engine.kv.blocks_for(head.prompt_tokens + head.output_tokens) \
            - engine.kv.available_blocks()
        if short <= 0:
            return False
        need_bytes = math.ceil(short / lease.blocks_per_slab) * slot.table.dims.slab_bytes
        # Section 5.3: an active model's T_compute is its decode step's. Bug guarded: a
        # prefill's compute (4 to 10x a decode's) let it lend layers that every later decode
        # step then streamed above its compute.
        compute = {slot.spec.model.name: step.alone_s} \
            if step is not None and step.kind == "decode" else {}
        plan = plan_lending(self._states(now_s), need_bytes, self._transfer(), compute)
        if not plan.order:
            return False
        self.ledgers[slot.spec.model.name].apply(plan)
        self.stats.lend_events += 1
        self.stats.layers_lent += len(plan.order)
        self.stats.max_layers_lent = max(self.stats.max_layers_lent, self.num_lent)
        self._set_placeholders(slot)
        logger.debug("oneiros: lent %s to %s at %.3f s", plan.layers, slot.spec.model.name,
                     now_s)
        return True

    def _revert_empty(self, slot: _Slot, now_s: float) -> None:
        """Give back the lent layers whose KV in `slot` (the borrower: the active model) is
        empty, latest lent first."""
        ledger = self.ledgers[slot.spec.model.name]
        if not ledger.order or self.active != slot.spec.model.name:
            return
        free = int(np.count_nonzero(slot.table.state == 0)) * slot.table.dims.slab_bytes
        sizes = {n: s.spec.layer_bytes for n, s in self.slots.items()}
        empty = min(free, sum(sizes[n] for n, _ in ledger.order))
        back = plan_reversion(ledger.order, sizes, empty)
        if not back:
            return
        ledger.revert(back)
        self.stats.layers_reverted += len(back)
        for name, _ in back:
            owner = self.slots[name]
            owner.reload_until_s = max(owner.reload_until_s, now_s) + \
                self.cfg.transfer_s(owner.spec.layer_bytes)
        self._set_placeholders(slot)

    def _set_placeholders(self, slot: _Slot) -> None:
        """Hold all but floor(borrowed / slab) of the lendable slabs."""
        borrowed = sum(self.slots[n].spec.layer_bytes
                       for n, _ in self.ledgers[slot.spec.model.name].order)
        target = slot.table.dims.num_slabs - slot.own_slabs \
            - borrowed // slot.table.dims.slab_bytes
        target = max(0, target)
        held = slot.placeholders.size
        name = slot.spec.model.name
        if target < held:
            release_weight_slabs(slot.table, slot.holder, slot.placeholders[target:], name)
            slot.placeholders = slot.placeholders[:target]
        elif target > held:
            # from slab 0 on: a KV table's slab 0 is room like any other (from slab 1 on, a
            # free slab 0 left the placeholders one short: ArenaExhausted, issue #39)
            more = carve_weight_slabs(slot.table, slot.holder, target - held, lowest=0)
            slot.placeholders = np.concatenate([slot.placeholders, more])

    def lent_of(self, owner: str) -> frozenset[int]:
        """The layers of `owner` lent, to whichever borrower."""
        return frozenset().union(*(ledger.lent_of(owner) for ledger in self.ledgers.values()))

    @property
    def num_lent(self) -> int:
        return sum(len(ledger.order) for ledger in self.ledgers.values())

    def _states(self, now_s: float) -> list[ModelState]:
        return [ModelState(n, s.spec.priority, s.last_used_s, n == self.active,
                           s.spec.model.profile.shape.num_layers, s.spec.layer_bytes,
                           lent=self.lent_of(n), cap=s.cap)
                for n, s in self.slots.items()]

    def _transfer(self) -> dict[str, float]:
        return {n: self.cfg.transfer_s(s.spec.layer_bytes) for n, s in self.slots.items()}

    def _step_s(self, slot: _Slot, step: Step, now_s: float) -> float:
        """Compute, or the copy chain of its own lent layers (equations 4 and 5), or the end
        of a reload of layers given back to it, whichever is last."""
        name = slot.spec.model.name
        alpha = len(self.lent_of(name))
        shape = slot.spec.model.profile.shape
        stream = streaming(shape.num_layers, alpha, self.cfg.transfer_s(slot.spec.layer_bytes),
                           step.alone_s)
        self.stats.steps += 1
        if alpha:
            self.stats.streamed_steps += 1
            self.stats.streamed_bytes += (alpha + stream.beta) * slot.spec.layer_bytes
        return max(stream.step_s, slot.reload_until_s - now_s)

    def _push(self, at_s: float, name: str) -> None:
        self._seq += 1
        self._stall_switches = 0
        heapq.heappush(self._heap, (at_s, self._seq, name))


def simulate_streaming(models: Sequence[StreamModel], gpu_bytes: int, requests: Sequence[Request],
                       config: SimConfig, streaming_config: StreamingConfig
                       ) -> tuple[list[RequestOutcome], StreamingStats]:
    """Run once; the outcomes and the lending statistics (TBT samples among them)."""
    sim = StreamingSimulator(models, gpu_bytes, config, streaming_config)
    try:
        outcomes = sim.run(requests)
    finally:
        sim.close()
    return outcomes, sim.stats

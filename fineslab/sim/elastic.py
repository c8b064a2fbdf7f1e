"""The elastic simulator: more models than the GPUs hold, sleeping and waking (issue #16).

Like `simulator.py` (one process, deterministic, the real slab table and local scheduler), but
weights are not resident for ever: each GPU has one slab table holding weights and KV alike
(the elastic arena), and a model is asleep, waking or awake.

    asleep   no weight slabs, no KV; its requests wait (their TTFT clock runs from arrival)
    waking   its weight slabs are taken; awake after wake_s = weights / link + overhead
             (the host copy streamed over the host link, as the live wake reads its file)
    awake    serves through a `ReplicaEngine` on its GPU (Algorithm 2, the real allocator);
             sleeps when the policy says it idled long enough, or when evicted for a wake

Where a model wakes and whom it evicts is the `ElasticPolicy` (scheduler/elastic.py): fineslab's
`lru-idle` (home GPU, LRU idle eviction, idle timeout) or Prism*'s `prism` (lowest KV pressure
GPU, eviction of models idle past 45 s, only under pressure). A sleep is instant: an idle model
holds no KV, and giving slabs back is a table update. A wake that finds no room is retried
whenever memory is freed and at every idle check. Per GPU `ACTIVATION_RESERVE_BYTES` stay out
of the table (the running models' activations).

    events   arrivals (sorted), step ends, wake ends, idle checks every `check_s`
    each request ends as one outcome: served, dropped by the local scheduler, or never admitted
"""

from __future__ import annotations

import heapq
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.loadgen.metrics import RequestOutcome
from fineslab.scheduler.elastic import (
    ElasticPolicy,
    GpuView,
    ResidentView,
    WakeRequest,
    get_elastic_policy,
)
from fineslab.scheduler.local import get_batch_policy
from fineslab.scheduler.placement import GpuSpec
from fineslab.sim.config import SimConfig
from fineslab.sim.engine import ReplicaEngine
from fineslab.sim.kv import ReplicaKv, gpu_slab_plan
from fineslab.sim.simulator import FleetModel
from fineslab.slabs import RuntimeSlabs, SlabPlan, SlabTable
from fineslab.slabs.integrity import check_integrity
from fineslab.slabs.table import TableDims
from fineslab.slabs.weights import carve_weight_slabs, free_weight_slabs, release_weight_slabs
from fineslab.workload import Request

GIB = 1 << 30
ACTIVATION_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class ElasticSimConfig:
    """policy: `lru-idle` or `prism`; link_gib_s: host -> GPU copy bandwidth (PCIe 5 x16 with
    pinned memory gives about 24 GiB/s); wake_overhead_s: the control path of a wake."""

    policy: str = "lru-idle"
    idle_timeout_s: float = 30.0
    link_gib_s: float = 24.0
    wake_overhead_s: float = 0.05
    check_s: float = 1.0

    def __post_init__(self) -> None:
        if min(self.link_gib_s, self.check_s, self.idle_timeout_s) <= 0 or \
                self.wake_overhead_s < 0:
            raise ConfigError("link_gib_s, check_s and idle_timeout_s must be positive")

    def wake_s(self, weights_bytes: int) -> float:
        return weights_bytes / (self.link_gib_s * GIB) + self.wake_overhead_s


@dataclass
class ModelSlot:
    """One model's elastic state (mutable as it sleeps and wakes)."""

    model: FleetModel
    home_gpu: int | None
    state: str = "asleep"  # asleep | waking | awake
    gpu: int | None = None
    weight_slabs: np.ndarray | None = None
    last_used_s: float = 0.0
    pending: list[Request] = field(default_factory=list)
    wakes: int = 0
    evictions: int = 0


@dataclass
class GpuArena:
    """One GPU's table, its slab plan and the weight owner slot of each model on it."""

    spec: GpuSpec
    table: SlabTable
    plan: SlabPlan
    weight_slots: dict[str, int] = field(default_factory=dict)

    def weight_slabs_of(self, model: FleetModel) -> int:
        return math.ceil(model.profile.weights_bytes / self.plan.slab_bytes)


def home_gpus(models: Sequence[FleetModel], gpus: Sequence[GpuSpec]) -> dict[str, int]:
    """fineslab's homes: by expected weight traffic (rate x weights) descending, each model to
    the GPU with the least expected traffic so far (ties: the lowest id)."""
    load = {g.gpu_id: 0.0 for g in gpus}
    homes = {}
    for m in sorted(models, key=lambda m: (-m.rate_per_s * m.profile.weights_bytes, m.name)):
        gpu_id = min(load, key=lambda g: (load[g], g))
        homes[m.name] = gpu_id
        load[gpu_id] += m.rate_per_s * m.profile.weights_bytes
    return homes


class ElasticSimulator:
    def __init__(self, models: Sequence[FleetModel], gpus: Sequence[GpuSpec],
                 batch_policy: str, config: SimConfig, elastic: ElasticSimConfig) -> None:
        for m in models:
            if m.profile.tp != 1:
                raise ConfigError(f"{m.name}: the elastic simulator runs TP1 models only")
        self.config, self.elastic = config, elastic
        self.policy: ElasticPolicy = get_elastic_policy(elastic.policy, elastic.idle_timeout_s)
        self.batch_policy = batch_policy
        homes = home_gpus(models, gpus) if elastic.policy == "lru-idle" else {}
        self.slots = {m.name: ModelSlot(m, homes.get(m.name)) for m in models}
        self.folder = Path(tempfile.mkdtemp(prefix="fineslab-simel-"))
        self.arenas: dict[int, GpuArena] = {}
        self.engines: dict[tuple[str, int], ReplicaEngine] = {}
        self._leases: list[RuntimeSlabs] = []
        try:
            for gpu in gpus:
                self.arenas[gpu.gpu_id] = self._arena(gpu, [
                    m for m in models if homes.get(m.name, gpu.gpu_id) == gpu.gpu_id])
        except BaseException:
            self.close()
            raise
        self._heap: list[tuple[float, int, str, str, int]] = []
        self._seq = 0
        self._free_seen: dict[int, int] = {}  # free slabs per GPU at the last retry check
        self.outcomes: list[RequestOutcome] = []

    def _arena(self, gpu: GpuSpec, residents: list[FleetModel]) -> GpuArena:
        plan = gpu_slab_plan({m.name: m.profile for m in residents}, self.config.min_slab_bytes)
        num_slabs = (gpu.memory_bytes - ACTIVATION_RESERVE_BYTES) // plan.slab_bytes
        dims = TableDims(int(num_slabs), plan.slab_bytes, plan.max_blocks_per_slab,
                         max_runtimes=min(255, 2 * len(residents) + 2))
        table = SlabTable.create(self.folder / f"g{gpu.gpu_id}.table", dims, 0)
        arena = GpuArena(gpu, table, plan)
        for m in residents:
            if arena.weight_slabs_of(m) > num_slabs:
                raise ConfigError(f"{m.name}: weights larger than GPU {gpu.gpu_id}'s arena")
            arena.weight_slots[m.name] = table.register(f"{m.name}:w"[:64], plan.slab_bytes)
        return arena

    def close(self) -> None:
        for lease in self._leases:
            lease.close()
        for arena in self.arenas.values():
            arena.table.close()
        self._leases, self.arenas = [], {}
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- the event loop ---------------------------------------------------------------------
    def run(self, requests: Sequence[Request], duration_s: float) -> list[RequestOutcome]:
        arrivals = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        tick = 0.0
        while tick <= duration_s:
            self._push(tick, "tick", "", 0)
            tick += self.elastic.check_s
        next_arrival = 0
        while next_arrival < len(arrivals) or self._heap:
            if self._heap and (next_arrival == len(arrivals)
                               or self._heap[0][0] <= arrivals[next_arrival].arrival_s):
                now_s, _, kind, name, gpu_id = heapq.heappop(self._heap)
                self._on_event(kind, name, gpu_id, now_s)
            else:
                self._on_arrival(arrivals[next_arrival])
                next_arrival += 1
            if self.config.check_integrity:
                for arena in self.arenas.values():
                    check_integrity(arena.table)
        return self._collect()

    def _push(self, at_s: float, kind: str, name: str, gpu_id: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_s, self._seq, kind, name, gpu_id))

    def _on_event(self, kind: str, name: str, gpu_id: int, now_s: float) -> None:
        if kind == "step":
            self._on_step_end(self.engines[(name, gpu_id)], now_s)
        elif kind == "woken":
            self._on_woken(self.slots[name], now_s)
        else:
            self._sleep_idle(now_s)
            self._retry_wakes(now_s)  # time alone makes models evictable (Prism's threshold)

    def _on_arrival(self, request: Request) -> None:
        slot = self.slots.get(request.model)
        if slot is None:
            self.outcomes.append(RequestOutcome(
                request.request_id, request.model, request.arrival_s, request.prompt_tokens, 0,
                None, None, dropped="unplaced"))
            return
        slot.last_used_s = request.arrival_s
        if slot.state == "awake":
            engine = self._engine(slot)
            engine.enqueue(request)
            self._try_start(engine, request.arrival_s)
            return
        slot.pending.append(request)
        if slot.state == "asleep":
            self._try_wake(slot, request.arrival_s)

    def _on_step_end(self, engine: ReplicaEngine, now_s: float) -> None:
        freed = engine.finish_step(now_s)
        self.slots[engine.model].last_used_s = now_s
        self._try_start(engine, now_s)
        if freed:
            self._memory_freed(engine.gpu_ids[0], now_s, became_idle=not engine.busy)

    def _memory_freed(self, gpu_id: int, now_s: float, became_idle: bool = True) -> None:
        """Blocks or slabs came back on `gpu_id`: waiting engines there, then blocked wakes
        if a whole slab came back or a model became evictable (else nothing changed for
        them; the idle check retries them every `check_s` anyway)."""
        for (_, g), other in self.engines.items():
            if g == gpu_id and other.waiting:
                self._try_start(other, now_s)
        free = int(np.count_nonzero(self.arenas[gpu_id].table.state == 0))
        if became_idle or free > self._free_seen.get(gpu_id, -1):
            self._retry_wakes(now_s)
        self._free_seen[gpu_id] = free

    def _retry_wakes(self, now_s: float) -> None:
        for slot in self.slots.values():
            if slot.state == "asleep" and slot.pending:
                self._try_wake(slot, now_s)

    # -- sleep and wake ---------------------------------------------------------------------
    def _busy(self, slot: ModelSlot) -> bool:
        if slot.state == "waking":
            return True
        if slot.state != "awake":
            return False
        engine = self._engine(slot)
        return engine.busy or engine.load > 0

    def _views(self) -> list[GpuView]:
        views = []
        for gpu_id, arena in self.arenas.items():
            residents = tuple(
                ResidentView(s.model.name, arena.weight_slabs_of(s.model), s.last_used_s,
                             self._busy(s), rate_weight=_rate_weight(s.model))
                for s in self.slots.values() if s.gpu == gpu_id)
            free = free_weight_slabs(arena.table)  # as the launcher counts: not slab 0
            views.append(GpuView(gpu_id, arena.table.dims.num_slabs, free,
                                 arena.plan.slab_bytes, residents))
        return views

    def _try_wake(self, slot: ModelSlot, now_s: float) -> None:
        candidates = [a for a in self.arenas.values() if slot.model.name in a.weight_slots]
        need = {a.spec.gpu_id: a.weight_slabs_of(slot.model) for a in candidates}
        views = [v for v in self._views() if v.gpu_id in need]
        request = WakeRequest(slot.model.name, max(need.values()), slot.home_gpu,
                              _rate_weight(slot.model), now_s)
        decision = self.policy.wake(request, views)
        if decision is None:
            return
        for victim in decision.evict:
            self._sleep(self.slots[victim])
            self.slots[victim].evictions += 1
        arena = self.arenas[decision.gpu_id]
        try:
            slot.weight_slabs = carve_weight_slabs(
                arena.table, arena.weight_slots[slot.model.name], need[decision.gpu_id])
        except ArenaExhausted:
            return  # KV of busy residents holds the slabs; retried when memory is freed
        slot.state, slot.gpu = "waking", decision.gpu_id
        slot.wakes += 1
        self._push(now_s + self.elastic.wake_s(slot.model.profile.weights_bytes), "woken",
                   slot.model.name, decision.gpu_id)

    def _on_woken(self, slot: ModelSlot, now_s: float) -> None:
        slot.state, slot.last_used_s = "awake", now_s
        engine = self._engine(slot)
        for request in slot.pending:
            engine.enqueue(request)
        slot.pending = []
        self._try_start(engine, now_s)

    def _sleep(self, slot: ModelSlot) -> None:
        assert slot.state == "awake" and not self._busy(slot), f"{slot.model.name} is busy"
        assert slot.gpu is not None and slot.weight_slabs is not None
        arena = self.arenas[slot.gpu]
        release_weight_slabs(arena.table, arena.weight_slots[slot.model.name],
                             slot.weight_slabs, slot.model.name)
        slot.state, slot.gpu, slot.weight_slabs = "asleep", None, None

    def _sleep_idle(self, now_s: float) -> None:
        slept = set()
        for slot in self.slots.values():
            timeout = self.policy.idle_timeout_s(slot.model.name)
            if slot.state == "awake" and timeout is not None and not self._busy(slot) \
                    and now_s - slot.last_used_s >= timeout:
                slept.add(slot.gpu)
                self._sleep(slot)
        for gpu_id in slept:
            assert gpu_id is not None
            self._memory_freed(gpu_id, now_s)

    # -- engines ----------------------------------------------------------------------------
    def _engine(self, slot: ModelSlot) -> ReplicaEngine:
        assert slot.gpu is not None
        key = (slot.model.name, slot.gpu)
        if key not in self.engines:
            arena = self.arenas[slot.gpu]
            lease = RuntimeSlabs(arena.table, slot.model.name[:64],
                                 arena.plan.format_of(slot.model.name))
            self._leases.append(lease)
            m = slot.model
            self.engines[key] = ReplicaEngine(
                f"{m.name}#{slot.gpu}", m.name, m.profile, (slot.gpu,),
                get_batch_policy(self.batch_policy), m.ttft_slo_s, ReplicaKv([lease]),
                self.config)
        return self.engines[key]

    def _try_start(self, engine: ReplicaEngine, now_s: float) -> None:
        if engine.busy:
            return
        step = engine.plan_step(now_s)
        if step is None:
            return
        engine.step = step
        gpu_id = engine.gpu_ids[0]
        neighbours = sum(e.busy for (_, g), e in self.engines.items()
                         if g == gpu_id and e is not engine)
        end_s = now_s + step.alone_s * (1.0 + self.config.interference_per_neighbor * neighbours)
        self._push(end_s, "step", engine.model, gpu_id)

    def _collect(self) -> list[RequestOutcome]:
        outcomes = list(self.outcomes)
        for engine in self.engines.values():
            for request in list(engine.waiting.values()):
                engine.waiting.pop(request.request_id)
                outcomes.append(_never(request, engine.ttft_slo_s))
            outcomes += engine.outcomes
        for slot in self.slots.values():
            outcomes += [_never(r, slot.model.ttft_slo_s) for r in slot.pending]
        return sorted(outcomes, key=lambda o: (o.arrival_s, o.request_id))


def _never(request: Request, slo_s: float) -> RequestOutcome:
    return RequestOutcome(request.request_id, request.model, request.arrival_s,
                          request.prompt_tokens, 0, None, None, dropped="never admitted",
                          ttft_slo_s=slo_s)


def _rate_weight(model: FleetModel) -> float:
    """KVPR's SLO-weighted token rate (scheduler/placement/baselines.py)."""
    workload = model.profile.workload
    return model.rate_per_s * (workload.prompt_tokens + workload.output_tokens) / model.ttft_slo_s


def simulate_elastic(models: Sequence[FleetModel], gpus: Sequence[GpuSpec], batch_policy: str,
                     requests: Sequence[Request], duration_s: float, config: SimConfig,
                     elastic: ElasticSimConfig) -> tuple[list[RequestOutcome], dict[str, int]]:
    """Run once; the outcomes and the totals of wakes and evictions."""
    sim = ElasticSimulator(models, gpus, batch_policy, config, elastic)
    try:
        outcomes = sim.run(requests, duration_s)
    finally:
        sim.close()
    return outcomes, {"wakes": sum(s.wakes for s in sim.slots.values()),
                      "evictions": sum(s.evictions for s in sim.slots.values())}

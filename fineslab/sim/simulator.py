"""The discrete-event simulator: a fleet, a system (placer, local scheduler, KV mode), a
workload in; every request's outcome out. Single process, deterministic (no wall clock, no
unseeded randomness; ties broken by event sequence numbers).

    place     the real placer (`fineslab.scheduler.placement`) places the models' demands
    build     per GPU a real slab table (`sim.kv`; kvcached's system: a page pool, `sim.pages`),
              per replica a `ReplicaEngine` with the real local scheduler
              (`fineslab.scheduler.local`)
    run       two event sources merged in time order: request arrivals (from the workload) and
              step ends (a heap); a step end at the same instant as an arrival goes first, so
              memory it frees is visible to the arrival
    route     a request goes to the least-loaded replica of its model (waiting + running;
              ties: the lowest replica index); a model the placer could not place drops its
              requests ("unplaced")

After every event the replicas that may now make progress are started: the one the event
touched, and, when blocks were freed, the idle residents of the same GPUs (they may have been
waiting for memory). Conservation: every request ends as exactly one outcome.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fineslab.loadgen.metrics import RequestOutcome, Summary, summarize, summarize_by_model
from fineslab.scheduler.local import get_batch_policy
from fineslab.scheduler.placement import (
    GpuSpec,
    ModelDemand,
    PlacementConfig,
    PlacementPlan,
    ReplicaPlacement,
    get_placement_policy,
)
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.scheduler.reclaim import ArenaUse, CacheReclaimPolicy
from fineslab.sim.config import SimConfig, SystemSpec
from fineslab.sim.engine import ReplicaEngine
from fineslab.sim.kv import FleetKv, GpuKvPlan, ReplicaKv, gpu_slab_plan
from fineslab.slabs.integrity import snapshot
from fineslab.workload import Request

logger = logging.getLogger(__name__)

#: The heap's index for a round of the reclaim loop (a step's end carries its replica's index).
RECLAIM = -1
#: An idle replica's turn for the cache squeeze carries SQUEEZE - its index.
SQUEEZE = -2


@dataclass(frozen=True)
class FleetModel:
    """A model to serve: its profile, the rate the placer sizes it for, its TTFT SLO."""

    name: str
    profile: ModelProfile
    rate_per_s: float
    ttft_slo_s: float


@dataclass(frozen=True)
class SimResult:
    system: str
    plan: PlacementPlan
    outcomes: tuple[RequestOutcome, ...]
    num_events: int
    wall_s: float
    #: Output tokens emitted by decode steps ending in [0, window_s], the arrival window (the
    #: workload's duration); a request's first token, which its prefill emits, is not counted.
    window_output_tokens: int
    window_s: float

    @property
    def window_tokens_per_s(self) -> float:
        """The paper's token generation throughput, "the average number of output tokens
        generated per second during the decode phase, excluding prefill": decode tokens per
        second of the arrival window, every request counted whether it met its SLO or not.
        Unlike bench_serving's total / duration it does not reward a system for dropping the
        requests that would have finished last."""
        return self.window_output_tokens / self.window_s

    def summary(self) -> Summary:
        return summarize(self.outcomes)

    def by_model(self) -> dict[str, Summary]:
        return summarize_by_model(self.outcomes)


def place(models: Sequence[FleetModel], gpus: Sequence[GpuSpec], placer: str,
          config: SimConfig) -> PlacementPlan:
    """The placer is told the interference factor the simulation runs with (as a real
    deployment would tell it a measured device property)."""
    demands = [ModelDemand(m.name, m.profile, m.rate_per_s, m.ttft_slo_s) for m in models]
    placement_config = PlacementConfig(interference_per_neighbor=config.interference_per_neighbor)
    # An experiment reports what a placer cannot place (a miss for each of its requests).
    return get_placement_policy(placer, placement_config).place(demands, gpus,
                                                                allow_unplaced=True)


def _non_kv_bytes(replica: ReplicaPlacement) -> int:
    point = replica.operating_point
    return point.weights_bytes + point.activation_bytes


def kv_plans(plan: PlacementPlan, profiles: dict[str, ModelProfile],
             config: SimConfig) -> dict[int, GpuKvPlan]:
    """Each GPU's slab plan, shared KV space and static partitions (see `sim.kv`)."""
    plans = {}
    for gpu in plan.gpus:
        residents = plan.replicas_on(gpu.gpu_id)
        if not residents:
            continue
        slab_plan = gpu_slab_plan({r.model: profiles[r.model] for r in residents},
                                  config.min_slab_bytes)
        shared = gpu.memory_bytes - sum(_non_kv_bytes(r) for r in residents)
        partitions = {}
        for r in residents:
            partition = (r.partition_bytes if r.partition_bytes is not None
                         else r.fixed_bytes + r.contested_share_bytes)
            partitions[f"{r.model}#{r.replica}"] = partition - _non_kv_bytes(r)
        plans[gpu.gpu_id] = GpuKvPlan(gpu.gpu_id, slab_plan, shared, partitions)
    return plans


class Simulator:
    """One run; use `simulate()` unless you need to inspect the state between events."""

    def __init__(self, models: Sequence[FleetModel], gpus: Sequence[GpuSpec],
                 system: SystemSpec, config: SimConfig,
                 plan: PlacementPlan | None = None) -> None:
        """`plan` replaces the system's placer (an experiment that fixes the placement)."""
        self.system, self.config = system, config
        self.models = {m.name: m for m in models}
        self.plan = plan or place(models, gpus, system.placer, config)
        self.kv = FleetKv(config=config)
        try:
            self.engines = self._build()
        except BaseException:
            self.kv.close()
            raise
        self.by_model: dict[str, list[int]] = {}
        self.by_gpu: dict[int, list[int]] = {}
        for index, engine in enumerate(self.engines):
            self.by_model.setdefault(engine.model, []).append(index)
            for gpu_id in engine.gpu_ids:
                self.by_gpu.setdefault(gpu_id, []).append(index)
        self.dropped: list[RequestOutcome] = []
        self.window_s = float("inf")
        self.window_output_tokens = 0
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self._reclaim = CacheReclaimPolicy(config.reclaim)
        #: replica -> the replicas whose cache squeeze it obeys at its next turn
        self._asked: dict[int, set[int]] = {}
        self._quiet_since: float | None = None
        self._cpu_ids = {g.gpu_id for g in self.plan.gpus if g.device == "cpu"}

    def _build(self) -> list[ReplicaEngine]:
        profiles = {name: m.profile for name, m in self.models.items()}
        gpu_kv = kv_plans(self.plan, profiles, self.config)
        engines = []
        for r in self.plan.replicas:
            key = f"{r.model}#{r.replica}"
            leases = [self.kv.lease(gpu_kv[g], key, r.model, self.system.kv_mode)
                      for g in r.gpu_ids]
            model = self.models[r.model]
            engines.append(ReplicaEngine(
                key, r.model, model.profile, r.gpu_ids, get_batch_policy(self.system.batch_policy),
                model.ttft_slo_s, ReplicaKv(leases), self.config))
        return engines

    def close(self) -> None:
        self.kv.close()

    # -- the event loop -------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> tuple[RequestOutcome, ...]:
        arrivals = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        next_arrival = 0
        if self.config.prefix_cache:
            self._push(self.config.reclaim.interval_s, RECLAIM)
        while next_arrival < len(arrivals) or self._heap:
            if self._heap and (next_arrival == len(arrivals)
                               or self._heap[0][0] <= arrivals[next_arrival].arrival_s):
                now_s, _, index = heapq.heappop(self._heap)
                if index == RECLAIM:
                    if self._on_reclaim(now_s, next_arrival < len(arrivals)):
                        self._push(now_s + self.config.reclaim.interval_s, RECLAIM)
                elif index <= SQUEEZE:
                    self._obey(SQUEEZE - index, now_s)
                else:
                    self._on_step_end(index, now_s)
            else:
                request = arrivals[next_arrival]
                next_arrival += 1
                self._on_arrival(request)
            if self.config.check_integrity:
                self.kv.check_integrity()
        return self._collect()

    def _on_arrival(self, request: Request) -> None:
        candidates = self.by_model.get(request.model)
        if not candidates:
            model = self.models.get(request.model)
            self.dropped.append(RequestOutcome(
                request.request_id, request.model, request.arrival_s, request.prompt_tokens, 0,
                None, None, dropped="unplaced",
                ttft_slo_s=model.ttft_slo_s if model else None))
            return
        index = min(candidates, key=lambda i: (self.engines[i].load, i))
        self.engines[index].enqueue(request)
        self._try_start(index, request.arrival_s)

    def _on_step_end(self, index: int, now_s: float) -> None:
        engine = self.engines[index]
        before = engine.tokens_emitted
        decode = engine.step is not None and engine.step.kind == "decode"
        freed = engine.finish_step(now_s)
        if decode and now_s <= self.window_s:
            self.window_output_tokens += engine.tokens_emitted - before
        self._obey(index, now_s)
        self._try_start(index, now_s)
        if freed:
            for gpu_id in engine.gpu_ids:
                for other in self.by_gpu[gpu_id]:
                    if other != index and self.engines[other].waiting:
                        self._try_start(other, now_s)

    def _try_start(self, index: int, now_s: float) -> None:
        engine = self.engines[index]
        if engine.busy:
            return
        step = engine.plan_step(now_s)
        if engine.short_blocks and self.config.prefix_cache and self.config.cache_squeeze:
            self._squeeze(index, now_s)
        if step is None:
            return
        engine.step = step
        self._push(now_s + step.alone_s * self._interference(index) + step.map_s, index)

    def _squeeze(self, index: int, now_s: float) -> None:
        """Replica `index` found its arena short: each replica beside it with a cache obeys at
        its next turn (`SimConfig.cache_squeeze`): a busy one when its step ends, an idle one
        after squeeze_idle_s on a CPU device, at once on a GPU."""
        for gpu_id in self.engines[index].gpu_ids:
            if self.kv.shared_table(gpu_id) is None:
                continue
            for other in self.by_gpu[gpu_id]:
                neighbour = self.engines[other]
                if other == index or not neighbour.cached or index in self._asked.get(other, ()):
                    continue
                first = other not in self._asked
                self._asked.setdefault(other, set()).add(index)
                if first and not neighbour.busy:
                    wait_s = self.config.squeeze_idle_s if gpu_id in self._cpu_ids else 0.0
                    self._push(now_s + wait_s, SQUEEZE - other)

    def _obey(self, index: int, now_s: float) -> None:
        """Replica `index`'s turn: give its cache back to the replicas that asked, and let
        each of them try again."""
        askers = self._asked.pop(index, set())
        for asker in sorted(askers):
            engine = self.engines[asker]
            if engine.short_blocks and self.engines[index].give_cache_for(engine):
                self._try_start(asker, now_s)

    def _push(self, at_s: float, index: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_s, self._seq, index))

    def _on_reclaim(self, now_s: float, arrivals_left: bool) -> bool:
        """One round of the launcher's reclaim loop on each shared arena (`SimConfig.
        prefix_cache`): the idle replicas the rule names give their cache back, and the
        replicas waiting there try again. True while a later round may still matter: arrivals
        are left, a step is in flight or this round flushed; else, while requests wait, until
        the rounds have been quiet longer than the rule's longest wait (its stall time and
        gap): a request that waits with nothing running and nothing the rule will flush would
        otherwise keep the rounds going for ever."""
        flushed_any = False
        for gpu_id, indices in self.by_gpu.items():
            table = self.kv.shared_table(gpu_id)
            if table is None:
                continue
            snap = snapshot(table)
            engines = {self.engines[i].key: self.engines[i] for i in indices}
            use = ArenaUse(str(gpu_id), tuple(engines), snap.free_slabs, snap.num_slabs,
                           {k: e.kv.used_blocks() for k, e in engines.items()},
                           {k: e.load for k, e in engines.items()})
            flushed = [k for k in self._reclaim.decide(use, now_s).flush
                       if engines[k].flush_cache()]
            if flushed:
                flushed_any = True
                for index in indices:
                    if self.engines[index].waiting:
                        self._try_start(index, now_s)
        if flushed_any or arrivals_left or any(e.busy for e in self.engines):
            self._quiet_since = None
            return True
        if self._quiet_since is None:
            self._quiet_since = now_s
        cfg = self.config.reclaim
        waited = now_s - self._quiet_since
        return (any(e.load for e in self.engines)
                and waited <= cfg.stall_s + cfg.min_gap_s + 2 * cfg.interval_s)

    def _interference(self, index: int) -> float:
        """1 + f * (other replicas busy on this replica's GPUs); on a CPU device with
        `cpu_cores` set, the busy replicas' threads over its cores (`SimConfig`)."""
        gpu_ids = self.engines[index].gpu_ids
        neighbors = {i for g in gpu_ids for i in self.by_gpu[g]} - {index}
        busy = sum(self.engines[i].busy for i in neighbors)
        cores = self.config.cpu_cores
        if cores is not None and all(g in self._cpu_ids for g in gpu_ids):
            threads = max(1, cores // (len(neighbors) + 1))
            return max(1.0, threads * (busy + 1) / cores)
        return 1.0 + self.config.interference_per_neighbor * busy

    def _collect(self) -> tuple[RequestOutcome, ...]:
        outcomes = list(self.dropped)
        for engine in self.engines:
            for request in list(engine.waiting.values()):
                engine.waiting.pop(request.request_id)
                engine.outcomes.append(RequestOutcome(
                    request.request_id, request.model, request.arrival_s,
                    request.prompt_tokens, 0, None, None, dropped="never admitted",
                    ttft_slo_s=engine.ttft_slo_s))
            outcomes += engine.outcomes
        return tuple(sorted(outcomes, key=lambda o: (o.arrival_s, o.request_id)))

    @property
    def num_events(self) -> int:
        return self._seq


def simulate(models: Sequence[FleetModel], gpus: Sequence[GpuSpec], system: SystemSpec,
             requests: Sequence[Request], window_s: float,
             config: SimConfig | None = None, plan: PlacementPlan | None = None) -> SimResult:
    """Place, build, run and clean up; the outcome of every request in `requests`.
    `window_s` is the arrival window the token throughput is measured over."""
    started = time.perf_counter()
    sim = Simulator(models, gpus, system, config or SimConfig(), plan)
    sim.window_s = window_s
    try:
        outcomes = sim.run(requests)
    finally:
        sim.close()
    wall_s = time.perf_counter() - started
    logger.info("%s: %d requests, %d steps, %.1f s wall", system.name, len(outcomes),
                sim.num_events, wall_s)
    return SimResult(system.name, sim.plan, outcomes, sim.num_events, wall_s,
                     sim.window_output_tokens, window_s)

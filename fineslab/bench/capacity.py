"""Live capacity: fineslab, SGLang's own scheduling and static partitions on one CPU fleet.

Issue #38: a multi-model fleet on real SGLang, fineslab against SGLang's own scheduling over
the same shared arena and against static partitions of it.

    python -m fineslab.bench.capacity [--json] [--quick] [--seeds N,...] [--workloads W,...]
                                      [--systems fineslab,shared-fcfs,static]
                                      (or fineslab-router, fineslab-margin)
                                      [--floor R] [--cpu-cores N] [--keep-logs DIR]
    python -m fineslab.bench.capacity --resimulate RUN.json [--cpu-cores N] [--json]

The fleet: three generated models of different sizes and precisions (llama-tiny BF16,
qwen2-tiny BF16, llama-small FP16) in one slab arena small enough that KV memory binds at the
rates probed, as it does on a GPU at high load. One fleet per system is launched and stays up
for the whole run (the routers and asleep runtimes cost little when idle):

    fineslab     shared slabs, the MME placement, `batch_policy: adaptive-early-shed` at the
                 router and `local_scheduler: engine` (Algorithm 2 picks SGLang's prefills)
    fineslab-router  the same with `local_scheduler: router` (Algorithm 2 gates at the router,
                 SGLang forms the batches): what decides the `local_scheduler` default; not in
                 --quick
    fineslab-margin  fineslab with `batch_policy: adaptive-early-shed-margin`: the same policy
                 in the router and the engine, dropping by predictions corrected by a margin
                 each learns from the first tokens of the requests it admitted
                 (`fineslab.scheduler.local.margin`); only when --systems names it
    shared-fcfs  the same shared arena, `batch_policy: fcfs`: SGLang's own scheduling forms
                 every batch (Prism's memory sharing without its scheduler)
    static       the same arena cut into fixed partitions: each model's KV limit
                 (`POST /admin/models/{m}/limit`, enforced by the allocator) is its share of the
                 arena in proportion to the footprint F_M the placer sized it with (the
                 simulator's Static*: `scheduler.placement.baselines.StaticPlacer`), and FCFS

Workloads (each model's requests: ShareGPT or the Azure trace's lengths divided by
`length_scale`, outputs capped at `max_output_tokens`):

    shift    Poisson arrivals whose per-model rates move: the run is cut into one phase per
             model, and in phase k model k gets `HOT` x its base rate, the others `COLD` x
             (the mean over phases is the base rate): memory a static partition gives a cold
             model is idle while the hot one queues
    replay   the Azure conversation trace compressed to the mix's total rate, each arrival
             given to a model in proportion to its base rate (bursts of the real trace)

Rates and SLOs come from this machine in this run, on the first fleet launched (shared-fcfs;
static before its limits when shared-fcfs is not asked for; a shared-fcfs fleet of its own,
stopped after, when neither is):
each model's profile is calibrated over HTTP (`sim.experiments.calibrate`, prompts up to the
P95 one), its TTFT SLO is `slo_scale` x the calibrated TTFT of the P95 prompt (the simulator's
rule; scale 20 by default: at the simulator's headline 5, 0.25-0.75 s here, every system missed
at rate scale 1 in one of two runs, the 2-core machine's jitter being larger), and a burst
measures the fleet's saturation throughput; rate scale 1 offers `BASE_LOAD` x that
throughput, split by the mix's weights. Every system then sees the same requests at each rate
scale (same seed, same scale: the same list).

Capacity is the largest rate scale at which TTFT attainment (requests whose first token came
within their model's SLO / all requests) stays >= the target, found by the simulator's
bisection (`sim.experiments.capacity.Bisection`: bracket by doubling, or by halving down to
`floor` when rate scale 1 misses, then bisect to `tolerance`),
for targets 0.99 and 0.90. The systems' searches are interleaved, one probe each in turn, so a
slow moment of the shared machine meets all of them. `sim` is the simulator's capacity for the
same fleet, workload and calibrated profiles: one CPU device with the arena as its KV space,
each system placed once at the base rates as its live fleet is, its runtimes taking turns on
this machine's cores (`SimConfig.cpu_cores`) and keeping finished requests' KV as their prefix
caches do, until a neighbour's cache squeeze asks for it (`SimConfig.prefix_cache`,
`cache_squeeze`); `sim_capacity_error` is the largest relative
error over the three systems. A run records its calibrated profiles, so that

    python -m fineslab.bench.capacity --resimulate RUN.json [--json]

runs today's simulator on it again (no fleet) and prints its live capacities beside the stored
and the new predictions.

Figures (last line with --json): per cell (workload, seed) and system every probe (rate scale,
attainment, goodput, drops, late, TTFT p99), capacities at 0.99 and 0.90, and at the top the
headline cell's `fineslab_capacity`, `shared_fcfs_capacity`, `static_capacity`,
`sim_capacity_error`, `fineslab_over_best_baseline` (and, when run, `fineslab_router_capacity`,
`fineslab_margin_capacity`, `engine_over_router_by_cell`, `margin_over_fineslab_by_cell`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from fineslab.bench.chaos_fleet import ChaosFleet
from fineslab.bench.engine_policy import engine_drops
from fineslab.bench.settle import SETTLED_BUSY, wait_settled
from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.plan import make_plan, model_dir_of
from fineslab.fleet.profiles import find_profile
from fineslab.loadgen.client import ClientConfig
from fineslab.loadgen.metrics import RequestOutcome
from fineslab.loadgen.run import BenchConfig, BenchResult, run_benchmark
from fineslab.scheduler.placement import GpuSpec
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import (
    ModelProfile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from fineslab.sim.config import SimConfig, SystemSpec
from fineslab.sim.experiments.calibrate import calibrate, load_average
from fineslab.sim.experiments.capacity import Bisection, Search
from fineslab.sim.simulator import FleetModel, place, simulate
from fineslab.tables import add_json_flag, emit, whole_number
from fineslab.workload import ModelLoad, Request, WorkloadSpec, build_workload
from fineslab.workload.traces import AZURE_CONV, SHAREGPT_STATS, load_lengths

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("fineslab", "fineslab-router", "fineslab-margin", "shared-fcfs", "static")
#: What runs when --systems is not given (fineslab-margin only when asked for).
DEFAULT_SYSTEMS = ("fineslab", "fineslab-router", "shared-fcfs", "static")
#: The baselines fineslab is measured against (fineslab-router is fineslab's own variant).
BASELINES = ("shared-fcfs", "static")
WORKLOADS = ("shift", "replay")
TARGETS = (0.99, 0.90)
HOT, COLD = 2.0, 0.5
#: Rate scale 1 offers this fraction of the measured saturation throughput.
BASE_LOAD = 0.25
SLO_PERCENTILE = 95.0
WARM_UP_ROUNDS = 2
CALIBRATION_REPEATS = 3
#: Each live system's fleet: its batch policy and local scheduler (module doc).
FLEET_POLICIES = {
    "fineslab": ("adaptive-early-shed", "engine"),
    "fineslab-router": ("adaptive-early-shed", "router"),
    "fineslab-margin": ("adaptive-early-shed-margin", "engine"),
    "shared-fcfs": ("fcfs", "router"),
    "static": ("fcfs", "router"),
}
#: The simulator's systems for the live ones (placer, batch policy, KV mode).
SIM_SYSTEMS = {
    "fineslab": SystemSpec("fineslab", "mme", "adaptive", "shared"),
    # The simulator has no engine: its scheduler is the router's gate and batches in one.
    "fineslab-router": SystemSpec("fineslab-router", "mme", "adaptive", "shared"),
    # Nothing feeds the margin in the simulator (its predictor is exact): Algorithm 2's figure.
    "fineslab-margin": SystemSpec("fineslab-margin", "mme", "adaptive-margin", "shared"),
    "shared-fcfs": SystemSpec("shared-fcfs", "mme", "fcfs", "shared"),
    "static": SystemSpec("static", "static", "fcfs", "static"),
}
#: The simulated arena's smallest slab (the live planner's are about 1 MiB at these sizes).
SIM_SLAB_BYTES = 1 << 20
FLEET_IDS = {"fineslab": "capfs", "fineslab-router": "capfr", "fineslab-margin": "capfm",
             "shared-fcfs": "capsh", "static": "capst"}


@dataclass(frozen=True)
class MixModel:
    name: str
    preset: str
    precision: str
    weight: float  # its share of the offered rate


MIX = (MixModel("tiny-bf16", "llama-tiny", "bf16", 1.0),
       MixModel("qwen-bf16", "qwen2-tiny", "bf16", 1.0),
       MixModel("small-fp16", "llama-small", "fp16", 0.5))


@dataclass(frozen=True)
class CapacityBenchConfig:
    workloads: tuple[str, ...] = WORKLOADS
    seeds: tuple[int, ...] = (0, 1)
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    duration_s: float = 40.0
    slo_scale: float = 20.0
    arena_mib: int = 12
    length_scale: int = 8
    max_prompt_tokens: int = 512
    max_output_tokens: int = 8
    max_running: int = 16
    start: float = 1.0
    #: When the start misses, the search halves down to this rate scale (a shift probe at x1
    #: can miss 99% for every system: capacity 0 for all says nothing).
    floor: float = 0.25
    tolerance: float = 0.25
    ceiling: float = 16.0
    #: Before each probe, wait up to this long for the machine to settle (bench/settle.py).
    settle_s: float = 30.0
    #: The cores the simulator's CPU device has (None: this machine's, recorded at the run).
    cpu_cores: int | None = None
    #: The runtimes' cache squeeze (`sglang_plugin.cache_squeeze`), live and in the simulator.
    #: A stored run without the key ran before it existed: `config_from_dict` reads False.
    cache_squeeze: bool = True
    mix: tuple[MixModel, ...] = MIX


QUICK = CapacityBenchConfig(workloads=("shift",), seeds=(0,), duration_s=20.0, tolerance=0.5,
                            systems=("fineslab", *BASELINES))


# -- the fleets ---------------------------------------------------------------------------------

def fleet_config(cfg: CapacityBenchConfig, system: str, fleet_id: str,
                 calibration: Calibration | None) -> dict[str, Any]:
    """The fleet of `system`; before the calibration (the first fleet) with the stored
    profiles, a placeholder SLO and the mix's weights as rates (its FCFS uses none of them)."""
    models = []
    for m in cfg.mix:
        slo_s = calibration.slo_s[m.name] if calibration else 5.0
        rate = calibration.rates[m.name] if calibration else m.weight
        model: dict[str, Any] = {"name": m.name, "preset": m.preset, "precision": m.precision,
                                 "kv_dtype": m.precision, "ttft_slo_s": slo_s,
                                 "request_rate_per_s": round(rate, 4)}
        if calibration:
            model["profile"] = str(calibration.profile_paths[m.name])
        if not cfg.cache_squeeze:
            model["cache_squeeze"] = False
        models.append(model)
    batch_policy, local_scheduler = FLEET_POLICIES[system]
    return {"fleet_id": fleet_id, "kv_pool": "arena", "placement": "mme",
            "batch_policy": batch_policy, "local_scheduler": local_scheduler,
            "devices": [{"name": "cpu", "kind": "cpu", "memory_gib": 8,
                         "kv_arena_mib": cfg.arena_mib}],
            "router": {"host": "127.0.0.1", "max_running_requests": cfg.max_running},
            "models": models}


def static_limits(config: dict[str, Any], arena_bytes: int) -> dict[str, int]:
    """Each model's KV limit: the arena cut in proportion to the F_M the static placer sized it
    with (its partition of the device, scaled to the arena, which is what binds here)."""
    plan = make_plan(fleet_from_dict({**config, "placement": "static"}, "capacity"))
    footprints = {r.model: r.fixed_bytes for r in plan.placement.replicas}
    total = sum(footprints.values())
    return {name: arena_bytes * f // total for name, f in footprints.items()}


def _set_limits(fleet: ChaosFleet, limits: dict[str, int]) -> None:
    for model, limit in limits.items():
        reply = httpx.post(f"{fleet.base_url}/admin/models/{model}/limit",
                           json={"kv_bytes": limit}, timeout=30)
        if reply.status_code != 200:
            raise RuntimeError(f"static: the KV limit of {model} was refused: {reply.text}")


# -- the workloads ------------------------------------------------------------------------------

def _scaled(cfg: CapacityBenchConfig, requests: list[Request]) -> list[Request]:
    return [replace(r, prompt_tokens=max(8, min(cfg.max_prompt_tokens,
                                                 r.prompt_tokens // cfg.length_scale)),
                    output_tokens=max(1, min(cfg.max_output_tokens, r.output_tokens)))
            for r in requests]


def workload(cfg: CapacityBenchConfig, kind: str, rates: dict[str, float], rate_scale: float,
             seed: int) -> list[Request]:
    """The requests of one probe: the same (kind, rates, scale, seed), the same list.
    ConfigError when it has none (a probe too short for the rate)."""
    requests = _requests(cfg, kind, rates, rate_scale, seed)
    if not requests:
        raise ConfigError(f"rate scale {rate_scale:g} offers no request in {cfg.duration_s:g} s "
                          f"of the {kind} workload: use a longer --duration")
    return requests


def _requests(cfg: CapacityBenchConfig, kind: str, rates: dict[str, float], rate_scale: float,
              seed: int) -> list[Request]:
    loads = tuple(ModelLoad(m.name, rates[m.name]) for m in cfg.mix)
    max_prompt = cfg.max_prompt_tokens * cfg.length_scale
    if kind == "replay":
        spec = WorkloadSpec(loads, cfg.duration_s, AZURE_CONV, arrival="replay",
                            rate_scale=rate_scale, max_prompt_tokens=max_prompt,
                            max_output_tokens=cfg.max_output_tokens, seed=seed)
        return _scaled(cfg, build_workload(spec))
    if kind != "shift":
        raise ValueError(f"unknown workload {kind!r}; known: {', '.join(WORKLOADS)}")
    phase_s = cfg.duration_s / len(loads)
    requests: list[Request] = []
    for k, hot in enumerate(loads):
        phase = tuple(replace(load, rate_per_s=load.rate_per_s * (HOT if load is hot else COLD))
                      for load in loads)
        spec = WorkloadSpec(phase, phase_s, SHAREGPT_STATS, rate_scale=rate_scale,
                            max_prompt_tokens=max_prompt,
                            max_output_tokens=cfg.max_output_tokens, seed=seed * 1000 + k)
        requests += [replace(r, request_id=f"p{k}-{r.request_id}", arrival_s=r.arrival_s +
                             k * phase_s) for r in build_workload(spec)]
    return _scaled(cfg, sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))


# -- what one run measures ----------------------------------------------------------------------

@dataclass
class Calibration:
    """What the first fleet measured: profiles, SLOs, the saturation throughput, base rates."""

    profiles: dict[str, ModelProfile]
    profile_paths: dict[str, Path]
    slo_s: dict[str, float]
    saturation_per_s: float
    rates: dict[str, float]


def _bench(base_url: str, slo_s: dict[str, float], timeout_s: float, seed: int) -> BenchConfig:
    return BenchConfig(ClientConfig(base_url, timeout_s=timeout_s), slo_s=dict(slo_s),
                       progress=False, seed=seed)


def measure_calibration(cfg: CapacityBenchConfig, fleet: ChaosFleet, folder: Path,
                        config: dict[str, Any]) -> Calibration:
    models = {m.name: m for m in fleet_from_dict(config, "capacity").models}
    bench = _bench(fleet.base_url, {}, 120.0, 0)
    profiles, paths, slo_s = {}, {}, {}
    p95 = _p95_prompt(cfg)
    for mix in cfg.mix:
        model = models[mix.name]
        base = find_profile(model, "cpu", [REPO / "profiles"], model_dir_of(model))
        profiles[mix.name] = calibrate(base, bench, mix.name, _probe_lengths(p95),
                                       CALIBRATION_REPEATS)
        paths[mix.name] = save_profile(profiles[mix.name], folder / "profiles")
        alone = ChunkedPrefillPredictor.from_profile(profiles[mix.name]).ttft_s([p95])
        slo_s[mix.name] = round(cfg.slo_scale * alone, 3)
        logger.info("%s: TTFT of the P95 prompt (%d tokens) alone %.3f s, SLO %.3f s",
                    mix.name, p95, alone, slo_s[mix.name])
    saturation = saturation_rate(cfg, bench)
    weights = sum(m.weight for m in cfg.mix)
    rates = {m.name: round(BASE_LOAD * saturation * m.weight / weights, 4) for m in cfg.mix}
    return Calibration(profiles, paths, slo_s, saturation, rates)


def _probe_lengths(p95: int) -> tuple[int, ...]:
    """Prefill probes up to the SLO's prompt, not a line fitted to 16-256 tokens and
    extrapolated to it (the SLO is a multiple of that one time)."""
    return tuple(sorted({16, max(16, p95 // 4), max(16, p95 // 2), p95}))


def _p95_prompt(cfg: CapacityBenchConfig) -> int:
    table = load_lengths(SHAREGPT_STATS, cfg.max_prompt_tokens * cfg.length_scale,
                         cfg.max_output_tokens)
    return max(8, table.percentile_prompt_tokens(SLO_PERCENTILE) // cfg.length_scale)


def saturation_rate(cfg: CapacityBenchConfig, bench: BenchConfig) -> float:
    """Requests/s the fleet completes with work always waiting: 3 x max_running requests of
    the mix's lengths, all at once (also the fleet's warm-up)."""
    even = {m.name: m.weight for m in cfg.mix}
    sample = workload(cfg, "shift", even, 10.0, 10_000)[: 3 * cfg.max_running]
    burst = [replace(r, request_id=f"saturate-{i}", arrival_s=0.0) for i, r in enumerate(sample)]
    result = run_benchmark(bench, burst)
    done = sum(1 for o in result.outcomes if o.completed)
    logger.info("saturation: %d of %d requests in %.1f s", done, len(burst), result.wall_s)
    if done == 0:
        raise RuntimeError("the saturation burst completed no request: is the fleet serving?")
    return done / result.wall_s


def warm_up(cfg: CapacityBenchConfig, fleet: ChaosFleet) -> None:
    """A fresh CPU server's first requests (and the first of each new length) are several
    times slower: every later fleet gets `WARM_UP_ROUNDS` of each model at each probed prompt
    length, 0.3 s apart (a burst would be shed by fineslab's gate)."""
    p95 = _p95_prompt(cfg)
    lengths = [n for _ in range(WARM_UP_ROUNDS) for n in _probe_lengths(p95)]
    warm = [Request(f"warm-{m.name}-{i}", m.name, 0.0, n, cfg.max_output_tokens)
            for i, n in enumerate(lengths) for m in cfg.mix]
    spaced = [replace(r, arrival_s=0.3 * i) for i, r in enumerate(warm)]
    run_benchmark(_bench(fleet.base_url, {}, 120.0, 0), spaced)


@dataclass(frozen=True)
class Probe:
    rate_scale: float
    attainment: float
    figures: dict[str, Any]


def _unanswered(outcome: RequestOutcome) -> str | None:
    """Why a request got no answer: "dropped" (refused, 429 or 503), "timed_out", "failed";
    None when it was answered."""
    if outcome.completed:
        return None
    reason = outcome.dropped or ""
    if reason.startswith(("HTTP 429", "HTTP 503")):
        return "dropped"
    return "timed_out" if "Timeout" in reason.split(":")[0] else "failed"


def probe_figures(result: BenchResult, wall_s: float) -> dict[str, Any]:
    outcomes, summary = result.outcomes, result.summary()
    met = sum(1 for o in outcomes if o.met_slo)
    unanswered = Counter(_unanswered(o) for o in outcomes)
    completed, p99 = summary.num_completed, summary.ttft_s.p99
    failures = Counter((o.dropped or "no answer")[:120] for o in outcomes
                       if _unanswered(o) == "failed")
    return {"requests": len(outcomes), "met": met, "late": completed - met,
            "dropped": unanswered["dropped"], "timed_out": unanswered["timed_out"],
            "failed": unanswered["failed"],
            # what each failed request got, so that a failure explains itself
            "failures": dict(failures.most_common(5)),
            "goodput_per_s": round(met / wall_s, 3), "ttft_p99_s": None if p99 is None
            else round(p99, 3),
            "attainment_by_model": {model: round(s.slo_attainment or 0.0, 4)
                                    for model, s in result.by_model().items()},
            "load_average": load_average()}


def live_probe(cfg: CapacityBenchConfig, fleet: ChaosFleet, calibration: Calibration,
               kind: str, seed: int, rate_scale: float) -> Probe:
    requests = workload(cfg, kind, calibration.rates, rate_scale, seed)
    # A request still waiting this long after its arrival has long missed its SLO: the client
    # gives up (the router aborts it), so an overloaded probe ends instead of draining a queue.
    timeout_s = 4 * max(calibration.slo_s.values()) + 30
    settled = wait_settled(cfg.settle_s, what=f"{fleet.fleet_id}'s probe at x{rate_scale:g}")
    drops_before = engine_drops(fleet.base_url)
    result = run_benchmark(_bench(fleet.base_url, calibration.slo_s, timeout_s, seed), requests)
    _wait_drained(fleet)
    figures = probe_figures(result, cfg.duration_s)
    figures["engine_drops"] = engine_drops(fleet.base_url) - drops_before
    figures.update(settled.figures())
    return Probe(rate_scale, round(figures["met"] / figures["requests"], 4), figures)


def _wait_drained(fleet: ChaosFleet, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(fleet.held_slots(m) == 0 for m in fleet.models):
            return
        time.sleep(0.5)
    logger.warning("%s: requests still held %.0f s after a probe", fleet.fleet_id, timeout_s)


# -- the searches -------------------------------------------------------------------------------

@dataclass
class SystemSearch:
    """One system's searches in one cell, one per target, probing shared rates once."""

    system: str
    searches: dict[float, Bisection]
    probes: dict[float, Probe] = field(default_factory=dict)

    def next_rate(self) -> float | None:
        for search in self.searches.values():
            rate = search.next_rate()
            if rate is not None:
                return rate
        return None

    def record(self, probe: Probe) -> None:
        self.probes[probe.rate_scale] = probe
        for search in self.searches.values():
            # The 0.90 search asks for rates the 0.99 one probed already: answered from them.
            while search.next_rate() in self.probes:
                search.record(self.probes[search.next_rate()].attainment)  # type: ignore[index]

    def results(self) -> dict[float, Search]:
        return {target: s.result() for target, s in self.searches.items()}


def new_search(cfg: CapacityBenchConfig, system: str) -> SystemSearch:
    return SystemSearch(system, {t: Bisection(cfg.start, cfg.tolerance, cfg.ceiling, t,
                                              cfg.floor)
                                 for t in TARGETS})


def interleave(searches: Sequence[SystemSearch],
               probe: Callable[[str, float], Probe]) -> None:
    """Probe the systems in turn, one probe each a round, until every search is over."""
    while True:
        pending = [s for s in searches if s.next_rate() is not None]
        if not pending:
            return
        for search in pending:
            rate = search.next_rate()
            if rate is not None:
                search.record(probe(search.system, rate))


def sim_searches(cfg: CapacityBenchConfig, calibration: Calibration, kind: str, seed: int,
                 arena_bytes: int) -> dict[str, SystemSearch]:
    """The simulator's capacity for the same fleet and requests: one CPU device whose memory
    is the models' weights and activations plus the arena and whose runtimes take turns on
    this machine's cores (`SimConfig.cpu_cores`) and keep finished requests' KV as SGLang's
    prefix cache does, until their own requests, a neighbour's cache squeeze or the reclaim
    rule take it back (`SimConfig.prefix_cache`, `cache_squeeze`). Each system is placed
    once, at the base rates, as its live fleet was: a placement redone at every rate scale
    left a model unplaced above x5.5, and that, not scheduling, set all four systems'
    simulated capacity."""
    models = [FleetModel(m.name, calibration.profiles[m.name], calibration.rates[m.name],
                         calibration.slo_s[m.name]) for m in cfg.mix]
    fixed = sum(p.weights_bytes + int(p.activation_bytes(1))
                for p in calibration.profiles.values())
    gpus = [GpuSpec(0, fixed + arena_bytes, "cpu")]
    config = SimConfig(max_running_requests=cfg.max_running, min_slab_bytes=SIM_SLAB_BYTES,
                       cpu_cores=cfg.cpu_cores or os.cpu_count() or 1, prefix_cache=True,
                       cache_squeeze=cfg.cache_squeeze)
    plans = {system: place(models, gpus, SIM_SYSTEMS[system].placer, config)
             for system in cfg.systems}

    def simulated(system: str, rate: float) -> Probe:
        requests = workload(cfg, kind, calibration.rates, rate, seed)
        scaled = [replace(m, rate_per_s=m.rate_per_s * rate) for m in models]
        summary = simulate(scaled, gpus, SIM_SYSTEMS[system], requests, cfg.duration_s,
                           config, plans[system]).summary()
        return Probe(rate, round(summary.slo_attainment or 0.0, 4), {})

    out = {system: new_search(cfg, system) for system in cfg.systems}
    interleave(list(out.values()), simulated)
    return out


# -- the run ------------------------------------------------------------------------------------

def run(cfg: CapacityBenchConfig, keep_logs: Path | None = None) -> dict[str, Any]:
    """The whole benchmark (module docstring). `keep_logs`: a folder, not there yet, that the
    fleets' configs, launcher output and runtime logs are moved to at the end (else deleted)."""
    cfg = replace(cfg, cpu_cores=cfg.cpu_cores or os.cpu_count() or 1)
    folder = Path(tempfile.mkdtemp(prefix="fineslab-capacity-"))
    fleets: dict[str, ChaosFleet] = {}
    started = time.monotonic()
    try:
        ids = {system: f"{FLEET_IDS[system]}{os.getpid() % 100_000}" for system in SYSTEMS}
        # The calibration needs an FCFS fleet: shared-fcfs, or static before its limits are set
        # (it then starts its probes with the calibration's prefix cache, which its limits do
        # not take back); with neither asked for, a shared-fcfs fleet is launched for it alone.
        calibrator = next((s for s in ("shared-fcfs", "static") if s in cfg.systems),
                          "shared-fcfs")
        first = fleet_config(cfg, calibrator, ids[calibrator], None)
        fleets[calibrator] = ChaosFleet.launch(first, folder, calibrator)
        calibration = measure_calibration(cfg, fleets[calibrator], folder, first)
        if calibrator not in cfg.systems:
            done = fleets.pop(calibrator)
            done.interrupt()
            done.cleanup()
        limits: dict[str, int] = {}
        arena_bytes = cfg.arena_mib << 20
        for system in cfg.systems:
            config = fleet_config(cfg, system, ids[system], calibration)
            if system not in fleets:
                fleets[system] = ChaosFleet.launch(config, folder, system)
            if system == "static":  # from the calibrated config, whichever fleet calibrated
                limits = static_limits(config, arena_bytes)
                _set_limits(fleets[system], limits)
            if system != calibrator:
                warm_up(cfg, fleets[system])
        cells = []
        for kind in cfg.workloads:
            for seed in cfg.seeds:
                cells.append(run_cell(cfg, fleets, calibration, kind, seed, arena_bytes))
    finally:
        for fleet in fleets.values():
            fleet.interrupt()
            fleet.cleanup()
        if keep_logs is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            keep_logs.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(folder), str(keep_logs))
            logger.info("the fleets' configs and logs: %s", keep_logs)
    return summarize(cfg, calibration, limits, cells, time.monotonic() - started)


def run_cell(cfg: CapacityBenchConfig, fleets: dict[str, ChaosFleet], calibration: Calibration,
             kind: str, seed: int, arena_bytes: int) -> dict[str, Any]:
    logger.info("cell %s seed %d", kind, seed)
    live = [new_search(cfg, system) for system in cfg.systems]

    def probe(system: str, rate: float) -> Probe:
        result = live_probe(cfg, fleets[system], calibration, kind, seed, rate)
        logger.info("%s %s seed %d: rate x%g attainment %.3f %s", system, kind, seed, rate,
                    result.attainment, result.figures)
        return result

    interleave(live, probe)
    sim = sim_searches(cfg, calibration, kind, seed, arena_bytes)
    systems = {}
    for search in live:
        found = search.results()
        predicted = sim[search.system].results()
        systems[search.system] = {
            "capacity": found[0.99].capacity, "capacity_90": found[0.90].capacity,
            "missed_at": found[0.99].missed_at,
            "goodput_per_s_at_capacity": _goodput_at(search, found[0.99].capacity),
            "probes": [{"rate_scale": p.rate_scale, "attainment": p.attainment, **p.figures}
                       for p in search.probes.values()],
            "sim_capacity": predicted[0.99].capacity,
            "sim_capacity_90": predicted[0.90].capacity,
            "sim_probes": [[p.rate_scale, p.attainment]
                           for p in sim[search.system].probes.values()],
        }
    return {"workload": kind, "seed": seed, "systems": systems}


def _goodput_at(search: SystemSearch, rate: float) -> float | None:
    probe = search.probes.get(rate)
    return None if probe is None else probe.figures.get("goodput_per_s")


def _error(live: float, sim: float) -> float | None:
    return None if live <= 0 else round(abs(sim - live) / live, 3)


def summarize(cfg: CapacityBenchConfig, calibration: Calibration, limits: dict[str, int],
              cells: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    head = cells[0]["systems"]

    def cap(system: str) -> float | None:
        return head[system]["capacity"] if system in head else None

    errors = [e for s in head.values() if (e := _error(s["capacity"], s["sim_capacity"]))
              is not None]
    baselines = [c for s in BASELINES if (c := cap(s)) is not None]
    ours, best = cap("fineslab"), max(baselines, default=None)
    ratios: dict[str, float | None] = {}
    engine: dict[str, float | None] = {}  # local_scheduler engine over router, by cell
    margin: dict[str, float | None] = {}  # fineslab-margin over fineslab, by cell
    for cell in cells:
        systems, name = cell["systems"], f"{cell['workload']}-{cell['seed']}"
        base = max((systems[s]["capacity"] for s in BASELINES if s in systems), default=0.0)
        if "fineslab" in systems:
            ratios[name] = round(systems["fineslab"]["capacity"] / base, 3) if base else None
        for over, under, out in (("fineslab", "fineslab-router", engine),
                                 ("fineslab-margin", "fineslab", margin)):
            if over in systems and under in systems:
                below = systems[under]["capacity"]
                out[name] = round(systems[over]["capacity"] / below, 3) if below else None
    return {"config": {**{k: v for k, v in cfg.__dict__.items() if k != "mix"},
                       "mix": [m.__dict__ for m in cfg.mix]},
            "headline": f"{cells[0]['workload']}-{cells[0]['seed']}",
            "slo_s": calibration.slo_s, "base_rates_per_s": calibration.rates,
            # what `--resimulate` needs to run the simulator again on this run's machine
            "profiles": {name: profile_to_dict(p) for name, p in calibration.profiles.items()},
            "saturation_per_s": round(calibration.saturation_per_s, 3),
            "static_kv_limits_bytes": limits, "cells": cells,
            "fineslab_capacity": ours, "shared_fcfs_capacity": cap("shared-fcfs"),
            "static_capacity": cap("static"),
            "fineslab_over_best_baseline": None if ours is None or not best
            else round(ours / best, 3),
            "fineslab_over_best_baseline_by_cell": ratios,
            "fineslab_router_capacity": cap("fineslab-router"),
            "engine_over_router_by_cell": engine,
            "fineslab_margin_capacity": cap("fineslab-margin"),
            "margin_over_fineslab_by_cell": margin,
            "sim_capacity_error": max(errors) if errors else None,
            "wall_s": round(wall_s, 1)}


# -- the simulator again on a stored run -------------------------------------------------------

def config_from_dict(data: dict[str, Any]) -> CapacityBenchConfig:
    """A stored run's `config` (lists back to tuples, the mix to `MixModel`s)."""
    known = set(CapacityBenchConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}")
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in data.items()}
    fields["mix"] = tuple(MixModel(**m) for m in data["mix"])
    fields.setdefault("cache_squeeze", False)  # runs before the squeeze had none
    return CapacityBenchConfig(**fields)


def resimulate(path: Path, cpu_cores: int | None = None) -> dict[str, Any]:
    """Today's simulator on a stored run (its `--json` output): the run's config, calibrated
    profiles, SLOs and base rates (`cpu_cores`, if given, for the run's), each cell's searches
    again; the live capacity, the stored prediction and the new one side by side. No fleet is
    launched."""
    try:
        stored = json.loads(path.read_text().strip().splitlines()[-1])
        profiles = {name: profile_from_dict(d, f"{path}: {name}")
                    for name, d in stored["profiles"].items()}
        cfg = config_from_dict(stored["config"])
        cfg = replace(cfg, cpu_cores=cpu_cores or cfg.cpu_cores or os.cpu_count() or 1)
        calibration = Calibration(profiles, {}, stored["slo_s"], stored["saturation_per_s"],
                                  stored["base_rates_per_s"])
        cells = stored["cells"]
    except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not the JSON of a capacity run that recorded its profiles "
                          f"({type(exc).__name__}: {exc})") from None
    out_cells, errors = [], {}
    for cell in cells:
        try:
            live = cell["systems"]
            sim = sim_searches(replace(cfg, systems=tuple(live)), calibration, cell["workload"],
                               cell["seed"], cfg.arena_mib << 20)
            systems = {}
            for name, found in live.items():
                predicted = sim[name].results()
                systems[name] = {"capacity": found["capacity"],
                                 "stored_sim_capacity": found["sim_capacity"],
                                 "sim_capacity": predicted[0.99].capacity,
                                 "sim_capacity_90": predicted[0.90].capacity,
                                 "error": _error(found["capacity"], predicted[0.99].capacity)}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{path}: a malformed cell ({type(exc).__name__}: {exc})") from None
        name = f"{cell['workload']}-{cell['seed']}"
        cell_errors = [e for s in systems.values() if (e := s["error"]) is not None]
        errors[name] = max(cell_errors) if cell_errors else None
        out_cells.append({"workload": cell["workload"], "seed": cell["seed"],
                          "systems": systems})
    return {"source": str(path), "cpu_cores": cfg.cpu_cores,
            "cells": out_cells, "sim_capacity_error_by_cell": errors,
            "sim_capacity_error": errors.get(stored.get("headline", ""))}


def resimulated_rows(out: dict[str, Any]) -> list[list[object]]:
    return [[cell["workload"], cell["seed"], system, s["capacity"], s["stored_sim_capacity"],
             s["sim_capacity"], s["error"]]
            for cell in out["cells"] for system, s in cell["systems"].items()]


# -- the command --------------------------------------------------------------------------------

def _names(known: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{what} are any of {', '.join(known)}; "
                                             f"got {text!r}")
        return names
    return parse


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(dict.fromkeys(int(s) for s in text.split(",") if s.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"seeds are integers, comma-separated; got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds are integers >= 0; got {text!r}")
    return seeds


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600, got {text}")
    return value


def rows_of(out: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for cell in out["cells"]:
        for system, s in cell["systems"].items():
            probes = " ".join(f"{p['rate_scale']:g}:{p['attainment']:.3f}" for p in s["probes"])
            rows.append([cell["workload"], cell["seed"], system, s["capacity"],
                         s["capacity_90"], s["goodput_per_s_at_capacity"], s["sim_capacity"],
                         probes])
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.capacity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the shift workload, seed 0, 20 s probes, tolerance 0.5, "
                             "without fineslab-router")
    parser.add_argument("--seeds", type=_seeds, default=None,
                        help="comma-separated (default 0,1; --quick: 0)")
    parser.add_argument("--workloads", type=_names(WORKLOADS, "workloads"), default=None,
                        help=f"comma-separated, any of {','.join(WORKLOADS)}")
    parser.add_argument("--systems", type=_names(SYSTEMS, "systems"), default=None,
                        help=f"comma-separated, any of {','.join(SYSTEMS)} (default "
                             f"{','.join(DEFAULT_SYSTEMS)}; --quick: "
                             f"{','.join(QUICK.systems)})")
    parser.add_argument("--duration", type=_positive, default=None,
                        help="seconds of arrivals per probe")
    parser.add_argument("--tolerance", type=_positive, default=None,
                        help="the bisection stops when its bracket is this narrow (rate scale)")
    parser.add_argument("--slo-scale", type=_positive, default=None,
                        help="each model's TTFT SLO = this x its calibrated TTFT of the P95 "
                             "prompt (default 20; 5 is the simulator's headline, below this "
                             "machine's jitter: docs/evaluation.md)")
    parser.add_argument("--ceiling", type=_positive, default=None,
                        help="the highest rate scale probed (default 16)")
    parser.add_argument("--floor", type=_positive, default=None,
                        help="when rate scale 1 misses, the search halves down to this one "
                             "(default 0.25)")
    parser.add_argument("--settle", type=_non_negative, default=None, metavar="S",
                        help="before each probe, wait up to S s for the CPUs to be under "
                             f"{SETTLED_BUSY * 100:.0f}%% busy (default 30; 0: one reading)")
    parser.add_argument("--resimulate", type=Path, default=None, metavar="FILE",
                        help="launch nothing: run today's simulator on a stored run (a "
                             "--json output that recorded its profiles) and print its live "
                             "capacities beside the stored and the new predictions")
    parser.add_argument("--cpu-cores", type=whole_number(1, 4096), default=None, metavar="N",
                        help="the simulated CPU device's cores (default: this machine's; with "
                             "--resimulate, the stored run's)")
    parser.add_argument("--no-cache-squeeze", action="store_true",
                        help="run the fleets, and the simulator, without the runtimes' cache "
                             "squeeze (as before 2026-11-30): the reclaim rounds alone give "
                             "cached memory back")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="move the fleets' configs, launcher output and runtime logs to DIR "
                             "(a new folder) at the end instead of deleting them")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.keep_logs is not None and args.keep_logs.exists():
        parser.error(f"--keep-logs {args.keep_logs} exists: name a new folder")
    if args.resimulate is not None:
        try:
            again = resimulate(args.resimulate, args.cpu_cores)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        emit(f"the simulator again on {args.resimulate} ({again['cpu_cores']} cores)",
             ["workload", "seed", "system", "live 99%", "stored sim", "sim 99%", "error"],
             resimulated_rows(again), again, args.json)
        return 0
    cfg = QUICK if args.quick else CapacityBenchConfig()
    changes = {"seeds": args.seeds, "workloads": args.workloads, "systems": args.systems,
               "duration_s": args.duration, "tolerance": args.tolerance,
               "ceiling": args.ceiling, "floor": args.floor, "slo_scale": args.slo_scale,
               "settle_s": args.settle, "cpu_cores": args.cpu_cores,
               "cache_squeeze": False if args.no_cache_squeeze else None}
    cfg = replace(cfg, **{k: v for k, v in changes.items() if v is not None})
    if cfg.ceiling < cfg.start:
        parser.error(f"--ceiling {cfg.ceiling:g} is below the first rate scale probed "
                     f"({cfg.start:g})")
    if cfg.floor > cfg.start:
        parser.error(f"--floor {cfg.floor:g} is above the first rate scale probed "
                     f"({cfg.start:g})")
    try:
        out = run(cfg, args.keep_logs)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    emit(f"capacity (rate scale 1 = {out['base_rates_per_s']} requests/s), TTFT SLOs "
         f"{out['slo_s']} s",
         ["workload", "seed", "system", "capacity 99%", "capacity 90%", "goodput/s",
          "sim 99%", "probes (rate:attainment)"], rows_of(out), out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every paper experiment shares: the model mix, SLOs, workloads and one sweep point.

    SLO of model m   = slo_scale * TTFT_m(P95 ShareGPT prompt), alone, from its profile (the
                       paper: "the P95 prefill latency from the ShareGPT dataset", scaled)
    rate of model m  = rate_scale * base_rate_m (req/s); the placer is told the same rate
    lengths          ShareGPT stats (prompt <= 8192, output <= 1024 tokens) for Poisson runs;
                     the Azure conversation trace's own lengths for replay runs
    profiles         analytical roofline profiles (scheduler.roofline) for the device, with
                     the ShareGPT mean request as their workload
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fineslab.scheduler.devices import get_device
from fineslab.scheduler.placement import GpuSpec
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import ModelProfile, Workload
from fineslab.scheduler.roofline import analytical_profile

from fineslab.sim.config import SimConfig, SystemSpec
from fineslab.sim.simulator import FleetModel, SimResult, simulate
from fineslab.workload import ModelLoad, Request, WorkloadSpec, build_workload, load_lengths

logger = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 8192
MAX_OUTPUT_TOKENS = 1024
SLO_PERCENTILE = 95.0


@dataclass(frozen=True)
class MixEntry:
    """A model variant of the paper's Table 3 and its request rate at rate scale 1."""

    model: str
    precision: str
    base_rate_per_s: float

    @property
    def name(self) -> str:
        return f"{self.model}-{self.precision}"


@dataclass(frozen=True)
class Traces:
    sharegpt: Path
    azure: Path


@dataclass(frozen=True)
class PointSpec:
    """One run of one system: the fleet, the mix, the scales, the workload."""

    mix: tuple[MixEntry, ...]
    num_gpus: int
    slo_scale: float
    rate_scale: float
    arrival: str  # "poisson" | "replay"
    duration_s: float
    seed: int = 0
    device: str = "h100"
    #: Fixed SLOs (s) by model name, overriding slo_scale * TTFT(P95 prompt) (fig13).
    slo_overrides_s: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class PointResult:
    system: str
    spec: PointSpec
    attainment: float
    tokens_per_s: float
    requests_per_s: float
    num_requests: int
    num_dropped: int
    unplaced: tuple[str, ...]
    by_model: dict[str, float] = field(default_factory=dict)  # model -> attainment
    by_model_req_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    #: requests per second that met their TTFT SLO (AIPerf's and `vllm bench serve`'s goodput)
    goodput_per_s: float = 0.0


def profile_for(entry: MixEntry, device: str, workload: Workload) -> ModelProfile:
    return analytical_profile(entry.model, entry.precision, device, workload=workload)


def fleet_models(spec: PointSpec, traces: Traces) -> list[FleetModel]:
    lengths = load_lengths(traces.sharegpt, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
    workload = Workload(round(lengths.mean_prompt_tokens), round(lengths.mean_output_tokens))
    slo_prompt_tokens = lengths.percentile_prompt_tokens(SLO_PERCENTILE)
    overrides = dict(spec.slo_overrides_s)
    models = []
    for entry in spec.mix:
        profile = profile_for(entry, spec.device, workload)
        base_slo_s = ChunkedPrefillPredictor.from_profile(profile).ttft_s([slo_prompt_tokens])
        slo_s = overrides.get(entry.name, base_slo_s * spec.slo_scale)
        models.append(FleetModel(entry.name, profile, entry.base_rate_per_s * spec.rate_scale,
                                 slo_s))
    return models


def gpus_for(spec: PointSpec, config: SimConfig) -> list[GpuSpec]:
    memory_bytes = int(get_device(spec.device).memory_bytes * config.gpu_memory_fraction)
    return [GpuSpec(i, memory_bytes, spec.device) for i in range(spec.num_gpus)]


def requests_for(spec: PointSpec, traces: Traces) -> list[Request]:
    workload = WorkloadSpec(
        tuple(ModelLoad(e.name, e.base_rate_per_s) for e in spec.mix), spec.duration_s,
        traces.sharegpt if spec.arrival == "poisson" else traces.azure, arrival=spec.arrival,
        rate_scale=spec.rate_scale, max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_output_tokens=MAX_OUTPUT_TOKENS, seed=spec.seed)
    return build_workload(workload)


def run_point(spec: PointSpec, systems: Sequence[SystemSpec], traces: Traces,
              config: SimConfig) -> list[PointResult]:
    """Every system on the same requests (same seed), one result each."""
    models = fleet_models(spec, traces)
    requests = requests_for(spec, traces)
    gpus = gpus_for(spec, config)
    results = []
    for system in systems:
        result = simulate(models, gpus, system, requests, spec.duration_s, config)
        results.append(point_result(system.name, spec, result))
        logger.info("%s %s: attainment %.3f, %.0f tok/s (%.1f s)", system.name,
                    _label(spec), results[-1].attainment, results[-1].tokens_per_s,
                    result.wall_s)
    return results


def point_result(name: str, spec: PointSpec, result: SimResult) -> PointResult:
    summary = result.summary()
    by_model = result.by_model()
    return PointResult(
        system=name, spec=spec, attainment=summary.slo_attainment or 0.0,
        tokens_per_s=result.window_tokens_per_s,
        requests_per_s=summary.request_throughput_per_s,
        num_requests=summary.num_requests, num_dropped=summary.num_dropped,
        unplaced=tuple(u.model for u in result.plan.unplaced),
        by_model={m: s.slo_attainment or 0.0 for m, s in by_model.items()},
        by_model_req_s={m: s.num_completed / spec.duration_s for m, s in by_model.items()},
        wall_s=result.wall_s, goodput_per_s=summary.goodput_per_s)


def _label(spec: PointSpec) -> str:
    return (f"{spec.num_gpus} GPUs, {spec.arrival}, rate x{spec.rate_scale:g}, "
            f"SLO x{spec.slo_scale:g}")

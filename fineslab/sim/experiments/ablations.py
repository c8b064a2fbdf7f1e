"""Figures 12 and 13: the placer and the local scheduler, each isolated (paper section 7.3).

fig12  2 H100s, models A = Llama-3.1-8B FP16, B = Llama-3.1-8B FP8, C = Llama-3.1-70B AWQ;
       static partitions and FCFS for both, MME placement (Algorithm 1) versus KVPR (Prism);
       request throughput (req/s) as the rate scale grows 1x..8x, SLO scale 20.
fig13  1 H100, Llama-3.1-8B FP16 alone, static KV; Algorithm 2 versus Moore-Hodgson versus
       FCFS at rate scales 1.66x and 2.0x; SLO = k x FCFS's P90 TTFT at that rate, k = 1..3.
       The placement is fixed (the model on GPU 0, sized for 1 req/s) so that the
       placer does not ask for DP replicas the single GPU cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from fineslab.scheduler.placement import PlacementPlan, ReplicaPlacement

from fineslab.sim.config import SimConfig, SystemSpec
from fineslab.sim.experiments.common import (
    MixEntry,
    PointResult,
    PointSpec,
    Traces,
    fleet_models,
    gpus_for,
    point_result,
    requests_for,
)
from fineslab.sim.experiments.report import (
    ATTAINMENT,
    REQUESTS,
    markdown_table,
    per_model_section,
    sweep_section,
    text_table,
    write_report,
)
from fineslab.sim.simulator import place, simulate

FIG12_MIX = (MixEntry("llama-3.1-8b", "fp16", 0.5), MixEntry("llama-3.1-8b", "fp8", 0.5),
             MixEntry("llama-3.1-70b", "awq", 0.12))
FIG12_SYSTEMS = (SystemSpec("mme-placer", "static", "fcfs", "static"),
                 SystemSpec("kvpr-placer", "kvpr", "fcfs", "static"))
FIG12_RATES = (1.0, 2.0, 4.0, 6.0, 8.0)
FIG13_MIX = (MixEntry("llama-3.1-8b", "fp16", 4.2),)
FIG13_SYSTEMS = (SystemSpec("fineslab", "static", "adaptive", "static"),
                 SystemSpec("prism", "static", "moore-hodgson", "static"),
                 SystemSpec("fcfs", "static", "fcfs", "static"))
FIG13_RATES = (1.66, 2.0)
FIG13_SLO_SCALES = (0.5, 1.0, 1.5, 2.0, 3.0)


@dataclass(frozen=True)
class AblationConfig:
    out_dir: Path
    traces: Traces
    quick: bool = False
    duration_s: float = 120.0
    seed: int = 0


def run_fig12(cfg: AblationConfig, config: SimConfig) -> tuple[dict[str, float], str]:
    rates = (1.0, 8.0) if cfg.quick else FIG12_RATES
    base = PointSpec(FIG12_MIX, 2, 20.0, 1.0, "poisson", cfg.duration_s, cfg.seed)
    points: list[PointResult] = []
    placements: list[list[object]] = []
    for rate in rates:
        spec = replace(base, rate_scale=rate)
        models, requests = fleet_models(spec, cfg.traces), requests_for(spec, cfg.traces)
        for system in FIG12_SYSTEMS:
            result = simulate(models, gpus_for(spec, config), system, requests,
                              spec.duration_s, config)
            points.append(point_result(system.name, spec, result))
            placements.append([rate, system.name, _describe(result.plan)])
            if rate == rates[-1]:
                points[-1] = replace(points[-1], by_model=points[-1].by_model_req_s)
    top = [p for p in points if p.spec.rate_scale == rates[-1]]
    body = "\n".join([
        "# Figure 12: placer ablation (static partitions, FCFS)", "",
        f"Reproduce: `python -m fineslab.sim fig12{' --quick' if cfg.quick else ''}`.", "",
        "## The paper", "", FIG12_PAPER, "", "## Ours", "",
        "Placements (the placer sizes models for each rate, so they can change with it; memory "
        "partitions in GiB, weights and activations included):", "",
        markdown_table(["rate_scale", "placer", "GPU: model (partition)"], placements), "",
        sweep_section("Request throughput as the rate grows", points, "rate_scale",
                      [REQUESTS, ATTAINMENT], cfg.out_dir, "fig12_rate"),
        per_model_section(top, f"Completed req/s per model at rate scale {rates[-1]:g}"),
        "## Why they differ", "", FIG12_WHY, ""])
    write_report(cfg.out_dir, "fig12", body)
    acceptance = {f"{p.system}_req_s": round(p.requests_per_s, 4) for p in top}
    return acceptance, text_table(points, "rate_scale", [REQUESTS, ATTAINMENT])


def _describe(plan: PlacementPlan) -> str:
    def partition_gib(r: ReplicaPlacement) -> float:
        partition = r.partition_bytes or r.fixed_bytes + r.contested_share_bytes
        return partition / float(1 << 30)

    return "; ".join(f"GPU {g.gpu_id}: " + ", ".join(
        f"{r.model} ({partition_gib(r):.1f})" for r in plan.replicas_on(g.gpu_id))
        for g in plan.gpus)


def run_fig13(cfg: AblationConfig, config: SimConfig) -> tuple[dict[str, float], str]:
    slo_scales = (0.5, 1.0, 3.0) if cfg.quick else FIG13_SLO_SCALES
    sections, tables, acceptance = [], [], {}
    for rate in FIG13_RATES:
        spec = PointSpec(FIG13_MIX, 1, 20.0, rate, "poisson", cfg.duration_s, cfg.seed)
        models, requests = fleet_models(spec, cfg.traces), requests_for(spec, cfg.traces)
        gpus = gpus_for(spec, config)
        # The placement is fixed: one replica on GPU 0, sized for 1 req/s (sized for the real
        # rate the placer would ask for DP replicas one GPU cannot hold).
        plan = place([replace(m, rate_per_s=1.0) for m in models], gpus, "static", config)
        fcfs = simulate(models, gpus, FIG13_SYSTEMS[2], requests, spec.duration_s, config, plan)
        ttfts = [o.ttft_s for o in fcfs.outcomes if o.ttft_s is not None]
        p90_s = float(np.percentile(ttfts, 90))
        points = []
        for k in slo_scales:
            tight = [replace(m, ttft_slo_s=k * p90_s) for m in models]
            point = replace(spec, slo_scale=k)
            for system in FIG13_SYSTEMS:
                result = simulate(tight, gpus, system, requests, spec.duration_s, config, plan)
                points.append(point_result(system.name, point, result))
        sections.append(sweep_section(
            f"Rate scale {rate:g}x (FCFS P90 TTFT {p90_s:.3f} s = SLO scale 1)", points,
            "slo_scale", [ATTAINMENT], cfg.out_dir, f"fig13_rate{rate:g}"))
        tables.append(f"rate scale {rate:g}\n" + text_table(points, "slo_scale", [ATTAINMENT]))
        acceptance.update({f"{p.system}_attainment_rate{rate:g}_slo{p.spec.slo_scale:g}":
                           round(p.attainment, 4) for p in points})
    body = "\n".join([
        "# Figure 13: local scheduler ablation (one model, static KV)", "",
        f"Reproduce: `python -m fineslab.sim fig13{' --quick' if cfg.quick else ''}`.", "",
        "## The paper", "", FIG13_PAPER, "", "## Ours", "", *sections,
        "## Why they differ", "", FIG13_WHY, ""])
    write_report(cfg.out_dir, "fig13", body)
    return acceptance, "\n\n".join(tables)


FIG12_PAPER = """Figure 12 / Table 4 (2 GPUs, static partitions, FCFS): FineServe puts C
(Llama-3.1-70B AWQ) alone on GPU 0 and co-locates B with A on GPU 1; Prism* co-locates C with
B on GPU 0. Under Prism*, the lone model scales with the rate but the co-located B and C lose
throughput from 4x to 8x; FineServe is stable and reaches up to 3x Prism*'s aggregate
throughput at 8x."""
FIG12_WHY = """- The MME placement is the paper's (70B AWQ alone, the two 8B models together) at
  every rate. KVPR's depends on the rate: up to 6x it puts 70B AWQ beside 8B FP16 and, since
  KVPR splits contested memory by SLO-weighted token rate, leaves 70B AWQ a partition of
  little more than its weights, so its requests queue for KV and the throughput falls behind
  the offered rate; at 8x it co-locates 70B AWQ with 8B FP8 as in Table 4.
- The paper's 3x gap at 8x comes from the co-located models of Prism* losing throughput in
  the real engine (preemption under KV pressure); our admission model has no preemption, so
  at 8x, where KVPR's partitions are large enough, both placements keep up.
- Sizes F_M come from our roofline profiles and base rates, not the paper's measurements."""
FIG13_PAPER = """Figure 13 (Llama-3.1-8B FP16 alone, static KV, rate scales 1.66x and 2.0x,
SLO = scale x FCFS's P90 TTFT): FineServe reaches up to 45.34% higher SLO attainment than FCFS
and up to 8.87% higher than Prism*; the largest gap to Prism* is at rate 2.0x and SLO scale 3,
where Prism* batches many requests into one chunked prefill that then misses deadlines."""
FIG13_WHY = """- Our base rate (4.2 req/s of ShareGPT requests at scale 1) is chosen so that
  1.66x (7 req/s) sits at the edge of one H100's simulated capacity and 2.0x (8.4 req/s)
  beyond it; the paper's base is not stated. Beyond capacity FCFS's queue grows for the whole
  run, so its P90 TTFT (the SLO unit) is long and all three meet nearly every deadline from
  SLO scale 1.5 on.
- Algorithm 2 and Moore-Hodgson end close: with one model and one SLO, EDF order is arrival
  order, and the paper's gap (Prism* batching too many requests into one chunked prefill)
  needs large SLOs where both already meet nearly every deadline in our model.
- Algorithm 2 drops requests it cannot serve in time, which frees the GPU for the rest; FCFS
  serves everything late once a queue forms, so its attainment collapses under overload."""

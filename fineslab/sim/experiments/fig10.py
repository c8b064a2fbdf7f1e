"""Figure 10: end-to-end SLO attainment and token throughput on 4 H100s (paper section 7.2).

Systems: fineslab (MME placer + Algorithm 2 + shared slabs), Prism* (KVPR + Moore-Hodgson +
shared slabs), Static* (MME placement, F_M-proportional static partitions, FCFS).
Sweeps: SLO scale at rate scale 8, rate scale 2x..8x at SLO scale 20; Poisson arrivals with
ShareGPT lengths, then the Azure conversation trace replayed at the same mean rate.

The mix is Table 3 without Llama-3.1-70B FP16 (TP4 would take all four GPUs) and Qwen3-32B
FP16 (its TP2 weights leave too little KV on four GPUs for any placer to fit the rest); the
base rates (req/s at rate scale 1) are ours, chosen so that rate scale 8 offers about 7,700
output tokens/s, the edge of what the four GPUs sustain in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fineslab.sim.config import SYSTEMS, SimConfig, SystemSpec
from fineslab.sim.experiments.common import MixEntry, PointResult, PointSpec, Traces, run_point
from fineslab.sim.experiments.report import (
    ATTAINMENT,
    TOKENS,
    per_model_section,
    sweep_section,
    text_table,
    write_report,
)

FIG10_MIX = (
    MixEntry("llama-3.1-8b", "fp16", 0.5), MixEntry("llama-3.1-8b", "fp8", 0.5),
    MixEntry("llama-3.1-8b", "awq", 0.5), MixEntry("llama-3-8b", "qoq", 0.5),
    MixEntry("llama-3.1-70b", "awq", 0.12), MixEntry("llama-3.1-70b", "fp8", 0.12),
    MixEntry("qwen3-32b", "fp8", 0.25),
)
SLO_SCALES = (2.0, 5.0, 10.0, 15.0, 20.0)
RATE_SCALES = (2.0, 4.0, 6.0, 8.0)
PAPER = """The paper (Figure 10, 4 H100s, vLLM-based prototype, ShareGPT, Poisson): fineslab
has the highest SLO attainment and token throughput at every point. At SLO scale 20 and rate
scale 8 it reaches 2.2x the SLO attainment of Prism* and 1.2x that of Static*, and 1.8x / 1.5x
their token throughput (about 2.3K tokens/s). With tighter SLOs Prism* drops sharply; as the
rate grows Prism* saturates early and Static* grows slowly."""


@dataclass(frozen=True)
class Fig10Config:
    out_dir: Path
    traces: Traces
    quick: bool = False
    duration_s: float = 120.0
    seed: int = 0
    num_gpus: int = 4


def _systems() -> list[SystemSpec]:
    return [SYSTEMS["fineslab"], SYSTEMS["prism"], SYSTEMS["static"]]


def run_fig10(cfg: Fig10Config, config: SimConfig) -> tuple[dict[str, float], str]:
    """Run the sweeps (or, with quick, the rate 8 / SLO 20 point); returns the acceptance
    numbers and the text table printed by the CLI."""
    base = PointSpec(FIG10_MIX, cfg.num_gpus, 20.0, 8.0, "poisson", cfg.duration_s, cfg.seed)
    sections, tables = [], []
    acceptance: dict[str, float] = {}
    for arrival in ("poisson", "replay"):
        spec = replace(base, arrival=arrival)
        if cfg.quick:
            points = run_point(spec, _systems(), cfg.traces, config)
            slo_sweep, rate_sweep = points, points
        else:
            slo_sweep = [p for s in SLO_SCALES
                         for p in run_point(replace(spec, slo_scale=s), _systems(),
                                            cfg.traces, config)]
            rate_sweep = [p for r in RATE_SCALES
                          for p in run_point(replace(spec, rate_scale=r), _systems(),
                                             cfg.traces, config)]
        anchor = [p for p in rate_sweep if p.spec.rate_scale == 8.0]
        if arrival == "poisson":
            acceptance = _acceptance(anchor)
        label = "Poisson, ShareGPT lengths" if arrival == "poisson" else "Azure conv replay"
        sections.append(sweep_section(f"{label}: SLO scale sweep at rate scale 8", slo_sweep,
                                      "slo_scale", [ATTAINMENT, TOKENS], cfg.out_dir,
                                      f"fig10_{arrival}_slo"))
        sections.append(sweep_section(f"{label}: rate scale sweep at SLO scale 20",
                                      rate_sweep, "rate_scale", [ATTAINMENT, TOKENS],
                                      cfg.out_dir, f"fig10_{arrival}_rate"))
        sections.append(per_model_section(
            anchor, f"{label}: SLO attainment per model at rate 8, SLO 20"))
        tables.append(f"{label}, rate scale 8, SLO scale 20\n"
                      + text_table(anchor, "rate_scale", [ATTAINMENT, TOKENS]))
    write_report(cfg.out_dir, "fig10", _body(cfg, sections, acceptance))
    return acceptance, "\n\n".join(tables)


def _acceptance(points: list[PointResult]) -> dict[str, float]:
    by = {p.system: p for p in points}
    return {f"{name}_{key}": round(value, 4) for name in ("fineslab", "prism", "static")
            for key, value in (("attainment", by[name].attainment),
                               ("tok_s", by[name].tokens_per_s))}


def _body(cfg: Fig10Config, sections: list[str], acceptance: dict[str, float]) -> str:
    command = "python -m fineslab.sim fig10" + (" --quick" if cfg.quick else "")
    wins = all(acceptance[f"fineslab_{k}"] > acceptance[f"{b}_{k}"]
               for k in ("attainment", "tok_s") for b in ("prism", "static"))
    verdict = ("fineslab is above both baselines on both metrics"
               if wins else "fineslab is NOT above both baselines on both metrics")
    return "\n".join([
        "# Figure 10: end-to-end SLO attainment and token throughput (4 H100s)", "",
        f"Reproduce: `{command}` (seed {cfg.seed}, {cfg.duration_s:g} s of arrivals per "
        "point; tokens/s is the paper's token generation throughput: output tokens emitted by "
        "decode steps, first tokens from prefill excluded, SLO met or not, per second of the "
        "arrival window).", "",
        "## The paper", "", PAPER, "",
        "## Ours", "", f"At rate scale 8, SLO scale 20 (Poisson): {verdict}.", "",
        "```json", str(acceptance), "```", "", *sections,
        "## Why they differ", "", WHY, ""])


WHY = """- Latencies are roofline estimates of an H100 (docs/evaluation.md), not a measured vLLM
  prototype: our GPUs are faster than the paper's, so the base rates are ours, set to load
  the four GPUs to their edge at rate scale 8; absolute tokens/s are not comparable.
- The token throughput gap is small. With an SLO of 20x the P95 prefill time the fleet is
  mostly compute-bound and every system that places a model serves nearly all its tokens; in
  the paper Prism* and Static* lose tokens to KV exhaustion and preemption of the real engine,
  which our admission model (KV reserved for the whole request, no preemption) does not have.
- Since the placers place every model they can (fewer DP replicas, then a smaller operating
  point, before giving a model up; issue 7), KVPR no longer loses Llama-3.1-70B AWQ at rate 8,
  SLO 20: it places it at its smallest batch on GPU 3, and Prism* serves every request.
- Why Prism* is now ahead on both metrics at rate 8, SLO 20 (Poisson, quick): placement under
  the co-location interference factor (0.2 per busy neighbour). MME, which scores memory and
  not compute, puts three replicas on GPU 1 (the 70B FP8 TP2 shard, 8B FP8, 8B AWQ), so the
  70B FP8 steps see three neighbours over its two GPUs and the 8B AWQ queue waits; KVPR puts
  two replicas on every GPU. With the interference factor at 0 the MME placement emits more
  tokens in the window than KVPR's (8,054 against 8,035 tokens/s, both 100% attainment), and
  swapping local schedulers changes nothing for KVPR's placement. Algorithm 2 drops the 6
  requests (8B AWQ) that can no longer meet their deadline; Moore-Hodgson on the same
  placement serves them late (attainment 0.994, +20 tokens/s): that was the whole 0.1% gap
  before the placer fix.
- Static*'s losses come from its partitions: Llama-3.1-8B AWQ shares GPU 1 with the 70B FP8
  shard and 8B FP8, gets a partition proportional to its small F_M (a few GiB of KV for
  4 req/s) and queues under FCFS.
- Tight SLOs (scale 2 and 5): before issue 7 the MME sizing asked for more DP replicas than
  four GPUs hold and left whole models unplaced; it now trims DP replicas (each re-sized for
  the rate it carries) until every model has one. The full sweep in docs/results/fig10
  predates that change.
- The paper's mix and rates are not fully specified (which Table 3 variants ran on 4 GPUs,
  the base rate "derived from ShareGPT"); ours are stated in the module docstring."""

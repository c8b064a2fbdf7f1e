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
    verdict = _verdict(acceptance)
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


def _verdict(acceptance: dict[str, float]) -> str:
    """Whether fineslab is strictly above both baselines on both metrics; ties named."""
    ties, behind = [], []
    for key, label in (("attainment", "SLO attainment"), ("tok_s", "tokens/s")):
        for baseline in ("prism", "static"):
            ours, theirs = acceptance[f"fineslab_{key}"], acceptance[f"{baseline}_{key}"]
            if ours == theirs:
                ties.append(f"ties {baseline} on {label} ({ours:g})")
            elif ours < theirs:
                behind.append(f"is below {baseline} on {label} ({ours:g} < {theirs:g})")
    if not ties and not behind:
        return "fineslab is above both baselines on both metrics"
    return ("fineslab is NOT above both baselines on both metrics: it "
            + "; ".join([*behind, *ties]))


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
- The MME placer is told the co-location interference factor the simulator runs with (0.2
  per busy neighbour, `PlacementConfig.interference_per_neighbor`, an assumption like a
  measured device profile): it charges each neighbour its expected busy fraction (rate /
  capacity at its sized batch, at most 1), scores each resident's mu divided by 1 + 0.2 * that
  load and prefers GPUs on which every resident keeps an operating point within its TTFT SLO.
  Told nothing (factor 0, the paper's Algorithm 1) it scored memory only and put three
  replicas on GPU 1 (the 70B FP8 TP2 shard, 8B FP8, 8B AWQ): fineslab reached 0.995
  attainment and 7,648 tokens/s at rate 8, SLO 20 (quick), below Prism*'s 1.0 and 7,779,
  whose KVPR puts two replicas on every GPU. Now 8B AWQ goes to GPU 3 beside Qwen3-32B FP8
  and 8B QoQ to GPU 2 beside the 70B AWQ: fineslab 1.0 and 7,827 tokens/s. At SLO 20 no
  candidate breaks an SLO, so the change comes from the slowed mu alone. Static* places with
  the same placer (the paper: "placement follows the same policy as FineServe") and gains too
  (0.858 -> 0.943, 7,372 -> 7,682 tokens/s). KVPR is Prism's algorithm and is not told.
- fineslab and Prism* both serve every request in the quick run (60 s) at rate 8, SLO 20, so
  attainment ties at 1.0 there; an attainment above Prism*'s is not possible at that point. In
  the full run (120 s) Prism* misses 0.6% (Llama-3.1-70B AWQ at its smallest batch, 8B FP16):
  fineslab 1.0 / 7,996 tokens/s, Prism* 0.994 / 7,870, Static* 0.929 / 7,946 (placer told 0:
  fineslab 0.995 / 7,908, Static* 0.838 / 7,571).
- SLO scale 10 (full run) is the one point where the co-location placer still costs. The
  first version counted every neighbour as always busy: Qwen3-32B FP8 alone runs at 92% of
  its batch-16 capacity and had no batch within its SLO with even one neighbour, so three
  replicas shared GPU 0 and GPU 2: fineslab 0.957 / 7,585 tokens/s, Static* 0.414 / 6,899.
  Charged at expected busy fractions (every model here is sized at a batch it keeps 58-99%
  busy) Qwen3-32B FP8 still stays alone (it breaks above a load of 0.42), but 8B QoQ moves
  from GPU 2 to GPU 1, beside 8B FP16 and the 70B FP8 TP2 replica, whose neighbours on both
  its GPUs now weigh 3.62 (x1.72, feasible) instead of 4 always busy (x1.8, no batch within
  its SLO): fineslab 0.965 / 7,718 tokens/s, Static* 0.731 / 7,468, against 0.983 / 7,809
  and 0.782 / 7,550 with the placer told 0 (Prism* 0.986 / 7,866 either way). No other fig10
  point changes placement; at rate 2 fineslab and Static* gain 4 tokens/s over told 0; in the
  replay runs every system stays at 1.0 (SLO 10: +3 tokens/s from the same move).
- Static*'s losses come from its partitions: Llama-3.1-8B AWQ gets a partition proportional
  to its small F_M (a few GiB of KV for 4 req/s) and queues under FCFS.
- Tight SLOs (scale 2 and 5): the MME sizing asks for DP replicas; the placer trims them (each
  re-sized for the rate it carries) until every model has one.
- The paper's mix and rates are not fully specified (which Table 3 variants ran on 4 GPUs,
  the base rate "derived from ShareGPT"); ours are stated in the module docstring."""

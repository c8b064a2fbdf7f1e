"""Figure 11: SLO attainment as the fleet grows from 8 to 16 H100s (paper section 7.2).

The full Table 3 mix (nine variants, Llama-3.1-70B FP16 at TP4 and Qwen3-32B FP16 at TP2
included) at fig10's base rates times 8, SLO scale 20; the same three systems; 8, 10, ..., 16
GPUs. Poisson with ShareGPT lengths, then the Azure conversation trace replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fineslab.sim.config import SYSTEMS, SimConfig
from fineslab.sim.experiments.common import MixEntry, PointSpec, Traces, run_point
from fineslab.sim.experiments.fig10 import FIG10_MIX
from fineslab.sim.experiments.report import (
    ATTAINMENT,
    TOKENS,
    sweep_section,
    text_table,
    write_report,
)

FIG11_MIX = (*FIG10_MIX, MixEntry("llama-3.1-70b", "fp16", 0.12),
             MixEntry("qwen3-32b", "fp16", 0.25))
GPU_COUNTS = (8, 10, 12, 14, 16)
RATE_SCALE = 8.0
PAPER = """The paper (Figure 11, 8 to 16 H100s on two p5.48xlarge nodes): fineslab keeps its
SLO attainment steady (at least 96.9%); Static* rises from 80.1% as GPUs are added and stays
above Prism*, whose attainment suffers on GPUs shared with AWQ models (precision-agnostic
placement underestimates their memory use). Prism* does not reach fineslab's attainment even
with twice the GPUs."""
WHY = """- Same caveats as fig10 (roofline latencies, our base rates, KV reserved per request).
- At 8 GPUs the MME placer (fineslab and Static*) leaves Llama-3.1-70B AWQ unplaced: it
  places by F_M descending, the TP4 and TP2 models and the 32B models fill the GPUs first,
  and no GPU keeps the 41 GiB the 70B AWQ replica needs; KVPR, which spreads load by
  SLO-weighted rate, fits every model. So Prism* leads at 8 GPUs, against the paper. From 10
  GPUs on fineslab places everything and leads or ties.
- The MME placer is told the simulator's interference factor (0.2 per busy neighbour; see
  fig10). It changes the numbers only at 10 GPUs: fineslab 0.996 -> 1.0 and Static* 0.86 -> 0.939
  (Poisson): told 0 it put 8B AWQ on GPU 7 beside the 70B FP8 TP2 shard and 8B FP8, told 0.2
  beside Qwen3-32B FP8 on GPU 9. Charging neighbours at their expected busy fraction instead
  of always busy (fig10, SLO 10) leaves every fig11 placement as it was.
- A bigger fleet removes both baselines' handicaps: with enough GPUs KVPR places every model
  and Static*'s partitions grow, so the curves converge; the paper's gap at 16 GPUs comes from
  runtime memory contention next to AWQ models, which our admission model (a request is
  admitted only when all its KV fits, no preemption) does not reproduce."""


@dataclass(frozen=True)
class Fig11Config:
    out_dir: Path
    traces: Traces
    quick: bool = False
    duration_s: float = 120.0
    seed: int = 0


def run_fig11(cfg: Fig11Config, config: SimConfig) -> tuple[dict[str, float], str]:
    counts = (8, 16) if cfg.quick else GPU_COUNTS
    arrivals = ("poisson",) if cfg.quick else ("poisson", "replay")
    systems = [SYSTEMS["fineslab"], SYSTEMS["prism"], SYSTEMS["static"]]
    sections, tables = [], []
    acceptance: dict[str, float] = {}
    for arrival in arrivals:
        base = PointSpec(FIG11_MIX, counts[0], 20.0, RATE_SCALE, arrival, cfg.duration_s,
                         cfg.seed)
        points = [p for n in counts
                  for p in run_point(replace(base, num_gpus=n), systems, cfg.traces, config)]
        label = "Poisson, ShareGPT lengths" if arrival == "poisson" else "Azure conv replay"
        sections.append(sweep_section(f"{label}: GPUs 8 to 16, rate scale 8, SLO scale 20",
                                      points, "num_gpus", [ATTAINMENT, TOKENS], cfg.out_dir,
                                      f"fig11_{arrival}"))
        tables.append(label + "\n" + text_table(points, "num_gpus", [ATTAINMENT]))
        if arrival == "poisson":
            acceptance = {f"{p.system}_attainment_{p.spec.num_gpus}gpus": round(p.attainment, 4)
                          for p in points}
    command = "python -m fineslab.sim fig11" + (" --quick" if cfg.quick else "")
    body = "\n".join([
        "# Figure 11: SLO attainment from 8 to 16 GPUs", "",
        f"Reproduce: `{command}` (seed {cfg.seed}, {cfg.duration_s:g} s of arrivals per "
        "point).", "", "## The paper", "", PAPER, "", "## Ours", "", *sections,
        "## Why they differ", "", WHY, ""])
    write_report(cfg.out_dir, "fig11", body)
    return acceptance, "\n\n".join(tables)

"""More models than fit (issue #16): SLO attainment and the GPUs needed for 99% of it.

The fleet: 24 TP1 models (quick: 8), fine-tuned variants of Llama-3.1-8B as Prism's traces
serve them: half FP16, a quarter FP8, a quarter AWQ, on H100s (72 GiB of each in use). Their
weights alone (263 GiB for 24) need four GPUs before any KV; with a third of them active, the
active weights take about 88 GiB. Workloads (both reported, two seeds):

    bursty   Prism's bursty groups (fineslab.workload.bursty): a third of the models active at
             a time, the group redrawn every 20 s on average (180 changes an hour), each
             active model at `rate_per_s`
    steady   every model active all the time at a third of that rate (the same offered load,
             nothing to gain from sleeping: where elasticity can only cost)

Systems, each on the same requests:

    fineslab      elastic, `lru-idle` (home GPU, LRU idle eviction, 30 s idle timeout) +
                  Algorithm 2
    prism         elastic, `prism` (wake on the lowest-KVPR GPU, evict models idle > 45 s,
                  only under pressure) + Moore-Hodgson (Prism*)
    no-sleep      today's fineslab without sleep: the MME placer places what fits with all
                  weights resident; requests of models it cannot place are lost

Wakes cost weights / 24 GiB/s + 50 ms (the host copy over PCIe 5 with pinned memory) for both
elastic systems. SLO: `slo_scale` x the model's alone TTFT of a P95 ShareGPT prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import Workload

from fineslab.loadgen.metrics import summarize
from fineslab.sim.config import SYSTEMS, SimConfig
from fineslab.sim.elastic import ElasticSimConfig, simulate_elastic
from fineslab.sim.experiments.common import (
    SLO_PERCENTILE,
    MixEntry,
    PointSpec,
    Traces,
    gpus_for,
    profile_for,
)
from fineslab.sim.experiments.report import markdown_table, write_report
from fineslab.sim.simulator import FleetModel, simulate
from fineslab.workload import load_lengths
from fineslab.workload.bursty import BurstySpec, bursty_workload

logger = logging.getLogger(__name__)

VARIANTS = (MixEntry("llama-3.1-8b", "fp16", 0.0), MixEntry("llama-3.1-8b", "fp8", 0.0),
            MixEntry("llama-3.1-8b", "fp16", 0.0), MixEntry("llama-3.1-8b", "awq", 0.0))
SYSTEM_NAMES = ("fineslab", "prism", "no-sleep")
WORKLOADS = ("bursty", "steady")
TARGET = 0.99


@dataclass(frozen=True)
class ElasticExpConfig:
    out_dir: Path
    traces: Traces
    quick: bool = False
    duration_s: float = 300.0
    seeds: tuple[int, ...] = (0, 1)
    num_models: int = 24
    max_gpus: int = 6
    rate_per_s: float = 2.0
    slo_scale: float = 40.0
    active_fraction: float = 1 / 3
    switch_mean_s: float = 20.0


@dataclass(frozen=True)
class ElasticPoint:
    system: str
    workload: str
    seed: int
    num_gpus: int
    attainment: float
    num_requests: int
    wakes: int
    evictions: int


def fleet(cfg: ElasticExpConfig, rate_per_s: float) -> list[FleetModel]:
    lengths = load_lengths(cfg.traces.sharegpt, 8192, 1024)
    workload = Workload(round(lengths.mean_prompt_tokens), round(lengths.mean_output_tokens))
    slo_prompt = lengths.percentile_prompt_tokens(SLO_PERCENTILE)
    models = []
    for i in range(cfg.num_models):
        entry = VARIANTS[i % len(VARIANTS)]
        profile = profile_for(entry, "h100", workload)
        slo_s = ChunkedPrefillPredictor.from_profile(profile).ttft_s([slo_prompt]) * cfg.slo_scale
        models.append(FleetModel(f"{entry.name}-{i}", profile, rate_per_s, slo_s))
    return models


def run_point(cfg: ElasticExpConfig, workload: str, seed: int, num_gpus: int,
              config: SimConfig) -> list[ElasticPoint]:
    steady = workload == "steady"
    rate = cfg.rate_per_s * (cfg.active_fraction if steady else 1.0)
    models = fleet(cfg, rate)
    requests, _ = bursty_workload(BurstySpec(
        tuple(m.name for m in models), rate, 1.0 if steady else cfg.active_fraction,
        cfg.switch_mean_s, cfg.duration_s, cfg.traces.sharegpt, seed=seed))
    # The placer of no-sleep sizes for the mean rate a model sees.
    placed = [replace(m, rate_per_s=cfg.rate_per_s * cfg.active_fraction) for m in models]
    gpus = gpus_for(PointSpec((), num_gpus, cfg.slo_scale, 1.0, "poisson", cfg.duration_s),
                    config)
    points = []
    for system in SYSTEM_NAMES:
        wakes = evictions = 0
        if system == "no-sleep":
            outcomes = list(simulate(placed, gpus, SYSTEMS["fineslab"], requests,
                                     cfg.duration_s, config).outcomes)
        else:
            elastic = ElasticSimConfig(policy="lru-idle" if system == "fineslab" else "prism")
            batch = SYSTEMS["fineslab" if system == "fineslab" else "prism"].batch_policy
            outcomes, counts = simulate_elastic(placed, gpus, batch, requests, cfg.duration_s,
                                                config, elastic)
            wakes, evictions = counts["wakes"], counts["evictions"]
        summary = summarize(outcomes)
        points.append(ElasticPoint(system, workload, seed, num_gpus,
                                   summary.slo_attainment or 0.0, summary.num_requests,
                                   wakes, evictions))
        logger.info("elastic %s %s seed %d, %d GPUs: attainment %.3f (%d wakes, %d evictions)",
                    system, workload, seed, num_gpus, points[-1].attainment, wakes, evictions)
    return points


def gpus_needed(points: Sequence[ElasticPoint], system: str, workload: str,
                seed: int) -> int | None:
    """The fewest GPUs at which `system` reaches the target attainment (None: none swept)."""
    met = [p.num_gpus for p in points if (p.system, p.workload, p.seed) == (system, workload, seed)
           and p.attainment >= TARGET]
    return min(met) if met else None


def run_elastic(cfg: ElasticExpConfig, config: SimConfig) -> tuple[dict[str, float], str]:
    points = [p for workload in WORKLOADS for seed in cfg.seeds
              for n in range(1, cfg.max_gpus + 1)
              for p in run_point(cfg, workload, seed, n, config)]
    acceptance: dict[str, float] = {}
    for workload in WORKLOADS:
        for seed in cfg.seeds:
            for system in SYSTEM_NAMES:
                needed = gpus_needed(points, system, workload, seed)
                acceptance[f"{system}_{workload}_s{seed}_gpus_for_99"] = (
                    float(needed) if needed is not None else float("nan"))
    text = _tables(points, cfg)
    write_report(cfg.out_dir, "elastic", _body(cfg, text, acceptance))
    return acceptance, text


def _tables(points: Sequence[ElasticPoint], cfg: ElasticExpConfig) -> str:
    sections = []
    for workload in WORKLOADS:
        for seed in cfg.seeds:
            rows = []
            for n in range(1, cfg.max_gpus + 1):
                at = {p.system: p for p in points
                      if (p.workload, p.seed, p.num_gpus) == (workload, seed, n)}
                rows.append([n] + [f"{at[s].attainment:.3f}" for s in SYSTEM_NAMES]
                            + [f"{at[s].wakes}/{at[s].evictions}" for s in SYSTEM_NAMES[:2]])
            needed = ", ".join(f"{s} {gpus_needed(points, s, workload, seed) or '>'}"
                               for s in SYSTEM_NAMES)
            sections.append(f"### {workload}, seed {seed}\n\nGPUs for {TARGET:.0%}: {needed}\n\n"
                            + markdown_table(["GPUs", *SYSTEM_NAMES, "fineslab wakes/evictions",
                                              "prism wakes/evictions"], rows))
    return "\n\n".join(sections)


def _body(cfg: ElasticExpConfig, text: str, acceptance: dict[str, float]) -> str:
    command = ("python -m fineslab.sim elastic" + (" --quick" if cfg.quick else "")
               + (f" --rate {cfg.rate_per_s:g}" if cfg.rate_per_s != 2.0 else ""))
    return "\n".join([
        "# More models than fit: SLO attainment by GPU count", "",
        f"Reproduce: `{command}` ({cfg.num_models} models, {cfg.duration_s:g} s of arrivals, "
        f"{cfg.rate_per_s:g} req/s per active model, SLO scale {cfg.slo_scale:g}, seeds "
        f"{', '.join(map(str, cfg.seeds))}; the module docstring of "
        "`fineslab/sim/experiments/elastic.py` states the fleet, workloads and systems).", "",
        "```json", str(acceptance), "```", "", text, ""])

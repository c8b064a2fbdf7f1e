"""What each part of fineslab buys in capacity, and how KV memory pressure moves the ratios.

Issue #18 asks for `fineslab_capacity >= 2 * static_capacity` (and `>= 1.25 * prism`) on
fig10's fleet at Poisson, SLO scale 5 (`fineslab.sim capacity`). Static* differs from fineslab
in three parts at once, so this experiment takes them apart with the same bisection
(`capacity.bisect_capacity`) on the same requests:

    part         placer   local scheduler   KV
    static       static   FCFS              static partitions    Static*
    +alg2        static   Algorithm 2       static partitions    the local scheduler alone
    +sharing     MME      FCFS              shared slabs         the placer's shared budget
                                                                 and slab sharing, FCFS
    fineslab     MME      Algorithm 2       shared slabs

at every SLO scale of `SLO_SCALES` (Poisson). Then, at the headline cell, the memory each GPU
offers is varied (`SimConfig.gpu_memory_fraction`; every other experiment uses 0.9): sharing
KV can only buy capacity where KV space binds, so the ratios over Static* and Prism* are shown
as the KV space shrinks, and with twice each GPU's memory (1.8: KV space never binds, so what
is left is compute). Nothing here changes a system; the headline stays at 0.9.

For every search the report names what broke at the first miss above the capacity: the
models with the lowest attainment there, how many requests were dropped, what was unplaced.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fineslab.sim.config import SYSTEMS, SimConfig, SystemSpec
from fineslab.sim.experiments.capacity import (
    CapacityConfig,
    SystemCapacity,
    seeds_text,
    system_capacity,
)
from fineslab.sim.experiments.common import PointResult, PointSpec, Traces
from fineslab.sim.experiments.report import markdown_table, write_report

logger = logging.getLogger(__name__)

PARTS: tuple[SystemSpec, ...] = (
    SYSTEMS["static"],
    SystemSpec("+alg2", "static", "adaptive", "static"),
    SystemSpec("+sharing", "mme", "fcfs", "shared"),
    SYSTEMS["fineslab"],
)
SLO_SCALES = (2.0, 5.0, 10.0, 20.0)
#: Each GPU's memory offered, as a fraction of its capacity: every other experiment's 0.9, two
#: tighter, and twice the GPU (2 x 0.9): KV space that never binds, the compute-bound ceiling.
MEMORY_FRACTIONS = (1.8, 0.9, 0.8, 0.7)
HEADLINE_FRACTION = 0.9
MEMORY_SYSTEMS = ("fineslab", "prism", "static")
HEADLINE_SLO = 5.0
WORST_MODELS = 2  # models named per miss


@dataclass(frozen=True)
class Found:
    """One search: what it varied, for which system and seed, and what it found."""

    system: str
    slo_scale: float
    memory_fraction: float
    seed: int
    result: SystemCapacity


def _search(cfg: CapacityConfig, system: SystemSpec, slo_scale: float, seed: int,
            config: SimConfig) -> Found:
    base = PointSpec(cfg.rate_mix, cfg.num_gpus, slo_scale, cfg.start_rate_scale, "poisson",
                     cfg.duration_s, seed)
    found = Found(system.name, slo_scale, config.gpu_memory_fraction, seed,
                  system_capacity(base, system, cfg, config))
    logger.info("capacity parts: %s SLO x%g memory %.2f seed %d: %g", system.name, slo_scale,
                config.gpu_memory_fraction, seed, found.result.search.capacity)
    return found


def run_parts(cfg: CapacityConfig, config: SimConfig,
              slo_scales: Sequence[float] = SLO_SCALES,
              fractions: Sequence[float] = MEMORY_FRACTIONS) -> tuple[dict[str, float], str]:
    """Both sweeps (the CLI's: every SLO scale and memory fraction; `fractions` must hold
    HEADLINE_FRACTION and `slo_scales` HEADLINE_SLO); returns the JSON figures and the printed
    table, writes `<out>/capacity-parts.md`."""
    if HEADLINE_FRACTION not in fractions or HEADLINE_SLO not in slo_scales:
        raise ValueError(f"the sweeps must include memory {HEADLINE_FRACTION:g} and SLO scale "
                         f"{HEADLINE_SLO:g}")
    started = time.monotonic()
    headline = replace(config, gpu_memory_fraction=HEADLINE_FRACTION)
    parts = [_search(cfg, system, slo, seed, headline)
             for slo in slo_scales for system in PARTS for seed in cfg.seeds]
    memory = [_search(cfg, SYSTEMS[name], HEADLINE_SLO, seed,
                      replace(config, gpu_memory_fraction=fraction))
              for fraction in fractions for name in MEMORY_SYSTEMS
              for seed in cfg.seeds]
    figures = acceptance(parts, memory, cfg)
    wall_s = time.monotonic() - started
    parts_table = markdown_table(*_parts_rows(parts))
    write_report(cfg.out_dir, "capacity-parts",
                 _body(cfg, parts, memory, figures, parts_table, wall_s))
    return figures, parts_table + "\n\n" + markdown_table(*_memory_rows(memory))


def mean_capacity(found: Sequence[Found], system: str, slo_scale: float,
                  memory_fraction: float) -> float:
    values = [f.result.search.capacity for f in found
              if (f.system, f.slo_scale, f.memory_fraction) == (system, slo_scale,
                                                                memory_fraction)]
    if not values:
        raise KeyError(f"no search for {system} at SLO {slo_scale}, memory {memory_fraction}")
    return statistics.fmean(values)


def acceptance(parts: Sequence[Found], memory: Sequence[Found],
               cfg: CapacityConfig) -> dict[str, float]:
    """Each part's mean capacity per SLO scale, each system's per memory fraction, and
    fineslab's ratios over Static* and Prism* at each fraction (left out where the baseline's
    capacity is 0: JSON has no Infinity)."""
    figures: dict[str, float] = {}
    for slo in _slos(parts):
        for system in PARTS:
            figures[f"{system.name}_capacity_slo{slo:g}"] = mean_capacity(
                parts, system.name, slo, HEADLINE_FRACTION)
    for fraction in _fractions(memory):
        ours = mean_capacity(memory, "fineslab", HEADLINE_SLO, fraction)
        for name in MEMORY_SYSTEMS:
            figures[f"{name}_capacity_mem{fraction:g}"] = mean_capacity(
                memory, name, HEADLINE_SLO, fraction)
        for baseline in ("static", "prism"):
            theirs = mean_capacity(memory, baseline, HEADLINE_SLO, fraction)
            if theirs > 0:
                figures[f"fineslab_over_{baseline}_mem{fraction:g}"] = round(ours / theirs, 4)
    figures.update(tolerance=cfg.tolerance, duration_s=cfg.duration_s,
                   num_seeds=float(len(cfg.seeds)))
    return figures


def _slos(found: Sequence[Found]) -> list[float]:
    return list(dict.fromkeys(f.slo_scale for f in found))


def _fractions(found: Sequence[Found]) -> list[float]:
    return list(dict.fromkeys(f.memory_fraction for f in found))


def what_broke(found: Found) -> str:
    """At the first miss above the capacity: the worst models' attainment, drops, unplaced."""
    missed = found.result.search.missed_at
    if missed is None:
        return "met to the ceiling"
    point: PointResult = found.result.points[missed]
    worst = sorted(point.by_model.items(), key=lambda item: item[1])[:WORST_MODELS]
    text = f"at {missed:g}: " + ", ".join(f"{m} {a:.3f}" for m, a in worst)
    if point.num_dropped:
        text += f"; {point.num_dropped}/{point.num_requests} dropped"
    if point.unplaced:
        text += f"; unplaced {', '.join(dict.fromkeys(point.unplaced))}"
    return text


def _parts_rows(parts: Sequence[Found]) -> tuple[list[str], list[list[object]]]:
    headers = ["SLO scale", *(f"{p.name} capacity" for p in PARTS), "fineslab / static"]
    rows: list[list[object]] = []
    for slo in _slos(parts):
        caps = [mean_capacity(parts, p.name, slo, HEADLINE_FRACTION) for p in PARTS]
        ratio = f"{caps[-1] / caps[0]:.2f}" if caps[0] > 0 else "-"
        rows.append([f"{slo:g}", *(f"{c:g}" for c in caps), ratio])
    return headers, rows


def _memory_rows(memory: Sequence[Found]) -> tuple[list[str], list[list[object]]]:
    headers = ["memory fraction", *(f"{s} capacity" for s in MEMORY_SYSTEMS),
               "fineslab / static", "fineslab / prism"]
    rows: list[list[object]] = []
    for fraction in _fractions(memory):
        caps = [mean_capacity(memory, s, HEADLINE_SLO, fraction) for s in MEMORY_SYSTEMS]
        ratios = [f"{caps[0] / c:.2f}" if c > 0 else "-" for c in caps[2:0:-1]]
        rows.append([f"{fraction:g}", *(f"{c:g}" for c in caps), *ratios])
    return headers, rows


def _search_rows(found: Sequence[Found]) -> tuple[list[str], list[list[object]]]:
    headers = ["system", "SLO scale", "memory", "seed", "capacity", "what broke at the miss",
               "probes (rate: attainment)"]
    rows = [[f.system, f"{f.slo_scale:g}", f"{f.memory_fraction:g}", f.seed,
             f"{f.result.search.capacity:g}", what_broke(f),
             ", ".join(f"{r:g}: {a:.3f}" for r, a in f.result.search.probes)] for f in found]
    return headers, rows


def _body(cfg: CapacityConfig, parts: Sequence[Found], memory: Sequence[Found],
          figures: dict[str, float], parts_table: str, wall_s: float) -> str:
    command = "python -m fineslab.sim capacity-parts" + (" --quick" if cfg.quick else "")
    return "\n".join([
        "# Capacity by part, and under KV memory pressure", "",
        f"Reproduce: `{command}` ({seeds_text(cfg.seeds)}; Poisson arrivals with ShareGPT lengths; "
        f"{cfg.duration_s:g} s per probe; tolerance {cfg.tolerance:g} rate scale; fig10's "
        f"fleet on {cfg.num_gpus} H100s; {wall_s:.0f} s wall). Method: the module docstring "
        "of `fineslab/sim/experiments/capacity_parts.py`; the bisection is "
        "`fineslab.sim capacity`'s.", "",
        "## Figures (means over seeds)", "", "```json", str(figures), "```", "",
        f"## Parts (each GPU offers {HEADLINE_FRACTION:g} of its memory)", "", parts_table, "",
        f"## KV memory pressure (SLO scale {HEADLINE_SLO:g})", "",
        markdown_table(*_memory_rows(memory)), "",
        "## Every search", "", markdown_table(*_search_rows([*parts, *memory])), ""])


def default_config(out_dir: Path, traces: Traces, quick: bool, seed: int,
                   duration_s: float | None) -> CapacityConfig:
    """The quick run: one seed, 60 s probes, tolerance 0.25; the full run two seeds, 120 s,
    0.125 (as `fineslab.sim capacity`)."""
    return CapacityConfig(out_dir, traces, quick=quick,
                          duration_s=duration_s or (60.0 if quick else 120.0),
                          seeds=(seed,) if quick else (seed, seed + 1),
                          tolerance=0.25 if quick else 0.125)

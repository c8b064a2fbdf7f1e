"""Capacity (issue #18 item 2): the largest rate each system serves at 99% SLO attainment.

Two metrics, each for fineslab, Prism* and Static* (fig10's three systems), at SLO scales 5
and 20, for Poisson arrivals with ShareGPT lengths and for the Azure conversation replay:

    capacity        fig10's fleet (its mix on 4 H100s): the largest rate scale at which SLO
                    attainment >= 0.99, found by bisection (below)
    GPUs for 99%    Prism's metric: fig11's fleet (the full Table 3 mix) at rate scale 8, its
                    GPU count raised one at a time, as fig11 varies it, until attainment
                    >= 0.99; the fewest such GPUs

The bisection, on rate scale r:

    bracket   probe r = start (1); if it misses, capacity is 0 (below the lowest rate tried),
              or, given a floor, halve r until a probe meets (capacity 0 if none does down to
              the floor); else double r until a probe misses or r reaches the ceiling (64)
    bisect    lo = the highest rate that met, hi = the lowest that missed; probe (lo + hi) / 2
              until hi - lo <= tolerance
    answer    capacity = lo; the true threshold t of a monotone attainment lies in [lo, hi)

Every probe that meets becomes lo and every miss hi, so the probes never contradict a
monotone attainment. Attainment is not monotone here, though: the placer is told the offered
rate, so a higher rate can buy a different placement (fig10: fineslab at SLO 5 has 0.93 at
rate 8 and 0.96 at 12), and a GPU more can change the placement for the worse. The answer is
then one crossing, not necessarily the highest rate (or the fewest GPUs) that meets; the report
lists every probe and flags attainments that run against the trend by more than 0.01. Cost:
about 10 simulations per (system, workload, SLO scale, seed), each growing with rate and
duration; the GPU scan one per count per system.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fineslab.sim.config import SYSTEMS, SimConfig, SystemSpec
from fineslab.sim.experiments.common import MixEntry, PointResult, PointSpec, Traces, run_point
from fineslab.sim.experiments.fig10 import FIG10_MIX
from fineslab.sim.experiments.fig11 import FIG11_MIX
from fineslab.sim.experiments.report import markdown_table, write_report

logger = logging.getLogger(__name__)

TARGET = 0.99
SYSTEM_NAMES = ("fineslab", "prism", "static")
ARRIVALS = ("poisson", "replay")
SLO_SCALES = (5.0, 20.0)
HEADLINE = ("poisson", 5.0)
GPU_RATE_SCALE = 8.0  # fig11's rate scale
TREND_SLACK = 0.01  # an attainment against the trend by more than this is reported


@dataclass(frozen=True)
class CapacityConfig:
    out_dir: Path
    traces: Traces
    quick: bool = False
    duration_s: float = 120.0
    seeds: tuple[int, ...] = (0, 1)
    tolerance: float = 0.125  # rate scale units
    start_rate_scale: float = 1.0
    ceiling_rate_scale: float = 64.0
    rate_mix: tuple[MixEntry, ...] = FIG10_MIX  # capacity: fig10's fleet
    num_gpus: int = 4
    gpu_mix: tuple[MixEntry, ...] = FIG11_MIX  # GPUs for 99%: fig11's fleet
    min_gpus: int = 6  # fig11's mix needs 5+ GPUs for its weights alone
    max_gpus: int = 24


@dataclass(frozen=True)
class Search:
    """What a bisection found: the capacity, the miss above it and every probe."""

    capacity: float  # the highest rate scale probed that met the target; 0.0: the start missed
    missed_at: float | None  # the lowest probed above it that missed; None: met to the ceiling
    probes: tuple[tuple[float, float], ...]  # (rate scale, attainment), in probe order


class Bisection:
    """The bisection of the module docstring as a state machine: `next_rate()` names the rate
    to probe (None once the search is over), `record(attainment)` gives that probe's result.
    A driver can so step several searches in turn (`fineslab.bench.capacity` interleaves the
    live systems' probes so that a slow moment of the machine meets each of them)."""

    def __init__(self, start: float, tolerance: float, ceiling: float,
                 target: float = TARGET, floor: float | None = None) -> None:
        """`floor`: when the start misses, halve down to it (None: capacity 0 at once)."""
        if not 0 < start <= ceiling or tolerance <= 0:
            raise ValueError(f"need 0 < start <= ceiling and tolerance > 0, got start {start}, "
                             f"ceiling {ceiling}, tolerance {tolerance}")
        if floor is not None and not 0 < floor <= start:
            raise ValueError(f"need 0 < floor <= start, got floor {floor}, start {start}")
        self.tolerance, self.ceiling, self.target, self.floor = tolerance, ceiling, target, floor
        self.probes: list[tuple[float, float]] = []
        self.lo: float | None = None  # the highest rate that met
        self.hi: float | None = None  # the lowest rate above lo that missed
        self._next: float | None = start

    def next_rate(self) -> float | None:
        return self._next

    def record(self, attainment: float) -> None:
        rate = self._next
        if rate is None:
            raise RuntimeError("the search is over: no probe was asked for")
        self.probes.append((rate, attainment))
        if attainment >= self.target:
            self.lo = rate
        else:
            self.hi = rate
        self._next = self._decide()

    def _decide(self) -> float | None:
        if self.lo is None:  # the start missed (so hi is set): halve down to the floor, if any
            if self.floor is None or self.hi is None or self.hi / 2 < self.floor:
                return None
            return self.hi / 2
        if self.hi is None:
            return None if self.lo >= self.ceiling else min(2 * self.lo, self.ceiling)
        return (self.lo + self.hi) / 2 if self.hi - self.lo > self.tolerance else None

    def result(self) -> Search:
        return Search(self.lo or 0.0, self.hi, tuple(self.probes))


def bisect_capacity(attainment_at: Callable[[float], float], start: float, tolerance: float,
                    ceiling: float, target: float = TARGET, floor: float | None = None) -> Search:
    """The largest rate meeting `target`: bracket by doubling from `start` (by halving down to
    `floor` when the start misses), then bisect until the bracket is at most `tolerance` wide
    (module docstring)."""
    search = Bisection(start, tolerance, ceiling, target, floor)
    while (rate := search.next_rate()) is not None:
        search.record(attainment_at(rate))
    return search.result()


@dataclass(frozen=True)
class SystemCapacity:
    """A system's bisection and, per probed rate scale, the replicas its placer could not
    place (a model with none placed loses every request: a placement cliff, not a queue) and
    the probe's whole result."""

    search: Search
    unplaced: dict[float, tuple[str, ...]]
    points: dict[float, PointResult]


def system_capacity(base: PointSpec, system: SystemSpec, cfg: CapacityConfig,
                    config: SimConfig) -> SystemCapacity:
    """Bisect `system`'s capacity on `base` (its rate scale is the one varied)."""
    unplaced: dict[float, tuple[str, ...]] = {}
    points: dict[float, PointResult] = {}

    def attainment_at(rate_scale: float) -> float:
        spec = replace(base, rate_scale=rate_scale)
        (point,) = run_point(spec, [system], cfg.traces, config)
        unplaced[rate_scale] = tuple(dict.fromkeys(point.unplaced))
        points[rate_scale] = point
        return point.attainment

    search = bisect_capacity(attainment_at, cfg.start_rate_scale, cfg.tolerance,
                             cfg.ceiling_rate_scale)
    return SystemCapacity(search, unplaced, points)


@dataclass(frozen=True)
class GpuScan:
    """The fewest GPUs meeting the target (None: none up to the scan's end), each probe and
    the replicas the placer could not place at each count."""

    num_gpus: int | None
    probes: tuple[tuple[int, float], ...]  # (GPUs, attainment)
    unplaced: dict[int, tuple[str, ...]]


def gpus_needed(base: PointSpec, systems: Sequence[str], cfg: CapacityConfig,
                config: SimConfig) -> dict[str, GpuScan]:
    """Raise the GPU count from min_gpus by one; each system stops at its first count that
    meets the target. Systems still scanning share a count's requests (one run_point)."""
    probes: dict[str, list[tuple[int, float]]] = {s: [] for s in systems}
    unplaced: dict[str, dict[int, tuple[str, ...]]] = {s: {} for s in systems}
    found: dict[str, int] = {}
    for num_gpus in range(cfg.min_gpus, cfg.max_gpus + 1):
        pending = [SYSTEMS[s] for s in systems if s not in found]
        if not pending:
            break
        for point in run_point(replace(base, num_gpus=num_gpus), pending, cfg.traces, config):
            probes[point.system].append((num_gpus, point.attainment))
            unplaced[point.system][num_gpus] = tuple(dict.fromkeys(point.unplaced))
            if point.attainment >= TARGET:
                found[point.system] = num_gpus
    return {s: GpuScan(found.get(s), tuple(probes[s]), unplaced[s]) for s in systems}


@dataclass(frozen=True)
class Cell:
    """One (workload, SLO scale, seed): each system's capacity and GPUs for 99%."""

    arrival: str
    slo_scale: float
    seed: int
    capacity: dict[str, SystemCapacity]
    gpus: dict[str, GpuScan]


def run_cell(cfg: CapacityConfig, arrival: str, slo_scale: float, seed: int,
             config: SimConfig) -> Cell:
    rate_base = PointSpec(cfg.rate_mix, cfg.num_gpus, slo_scale, cfg.start_rate_scale, arrival,
                          cfg.duration_s, seed)
    capacity = {s: system_capacity(rate_base, SYSTEMS[s], cfg, config) for s in SYSTEM_NAMES}
    gpu_base = PointSpec(cfg.gpu_mix, cfg.min_gpus, slo_scale, GPU_RATE_SCALE, arrival,
                         cfg.duration_s, seed)
    gpus = gpus_needed(gpu_base, SYSTEM_NAMES, cfg, config)
    logger.info("capacity %s SLO x%g seed %d: %s; GPUs for 99%%: %s", arrival, slo_scale, seed,
                {s: c.search.capacity for s, c in capacity.items()},
                {s: g.num_gpus for s, g in gpus.items()})
    return Cell(arrival, slo_scale, seed, capacity, gpus)


def run_capacity(cfg: CapacityConfig, config: SimConfig) -> tuple[dict[str, float], str]:
    """Every cell; returns the JSON figures and the text printed by the CLI, writes
    `<out>/capacity.md`."""
    started = time.monotonic()
    cells = [run_cell(cfg, arrival, slo, seed, config) for arrival in ARRIVALS
             for slo in SLO_SCALES for seed in cfg.seeds]
    wall_s = time.monotonic() - started
    figures = acceptance(cells, cfg)
    text = markdown_table(*_mean_rows(cells))
    write_report(cfg.out_dir, "capacity", _body(cfg, cells, figures, wall_s))
    return figures, text


def _mean_capacity(cells: Sequence[Cell], system: str, arrival: str, slo: float) -> float:
    return statistics.fmean(c.capacity[system].search.capacity for c in cells
                            if (c.arrival, c.slo_scale) == (arrival, slo))


def _mean_goodput(cells: Sequence[Cell], system: str, arrival: str, slo: float) -> float:
    """The mean over seeds of the goodput (req/s meeting the SLO) at each seed's capacity."""
    found = []
    for c in cells:
        if (c.arrival, c.slo_scale) == (arrival, slo):
            capacity = c.capacity[system]
            point = capacity.points.get(capacity.search.capacity)
            found.append(0.0 if point is None else point.goodput_per_s)
    return statistics.fmean(found)


def _mean_gpus(cells: Sequence[Cell], system: str, arrival: str, slo: float) -> float | None:
    """The mean over seeds of the GPUs for 99%; None if some seed met it nowhere."""
    found = [c.gpus[system].num_gpus for c in cells if (c.arrival, c.slo_scale) == (arrival, slo)]
    return None if None in found else statistics.fmean(n for n in found if n is not None)


def acceptance(cells: Sequence[Cell], cfg: CapacityConfig) -> dict[str, float]:
    """The headline (Poisson, SLO 5, mean over seeds), its ratios, and every cell's mean."""
    figures: dict[str, float] = {f"{s}_capacity": _mean_capacity(cells, s, *HEADLINE)
                                 for s in SYSTEM_NAMES}
    figures.update({f"{s}_goodput_per_s": round(_mean_goodput(cells, s, *HEADLINE), 4)
                    for s in SYSTEM_NAMES})
    for baseline in ("prism", "static"):
        # A baseline with capacity 0 has no finite ratio (JSON has no Infinity): left out.
        if figures[f"{baseline}_capacity"] > 0:
            figures[f"fineslab_over_{baseline}"] = round(
                figures["fineslab_capacity"] / figures[f"{baseline}_capacity"], 4)
    for arrival in ARRIVALS:
        for slo in SLO_SCALES:
            for s in SYSTEM_NAMES:
                figures[f"{s}_capacity_{arrival}_slo{slo:g}"] = _mean_capacity(
                    cells, s, arrival, slo)
                gpus = _mean_gpus(cells, s, arrival, slo)
                if gpus is not None:  # none found up to max_gpus: left out, the report says so
                    figures[f"{s}_gpus_for_99_{arrival}_slo{slo:g}"] = gpus
    figures.update(tolerance=cfg.tolerance, duration_s=cfg.duration_s,
                   num_seeds=float(len(cfg.seeds)), gpu_rate_scale=GPU_RATE_SCALE)
    return figures


def _mean_rows(cells: Sequence[Cell]) -> tuple[list[str], list[list[object]]]:
    headers = ["workload", "SLO scale", *(f"{s} capacity" for s in SYSTEM_NAMES),
               *(f"{s} GPUs for 99%" for s in SYSTEM_NAMES)]
    rows: list[list[object]] = []
    for arrival in ARRIVALS:
        for slo in SLO_SCALES:
            gpus = [_mean_gpus(cells, s, arrival, slo) for s in SYSTEM_NAMES]
            rows.append([arrival, f"{slo:g}",
                         *(f"{_mean_capacity(cells, s, arrival, slo):g}" for s in SYSTEM_NAMES),
                         *("-" if g is None else f"{g:g}" for g in gpus)])
    return headers, rows


def _cell_rows(cells: Sequence[Cell]) -> tuple[list[str], list[list[object]]]:
    headers = ["workload", "SLO scale", "seed", "system", "capacity", "missed at",
               "attainment at capacity", "goodput at capacity (req/s)",
               "probes (rate: attainment [unplaced])", "GPUs for 99%",
               "GPU probes (GPUs: attainment [unplaced])"]
    rows: list[list[object]] = []
    for c in cells:
        for s in SYSTEM_NAMES:
            search, scan = c.capacity[s].search, c.gpus[s]
            at_capacity = dict(search.probes).get(search.capacity)
            point = c.capacity[s].points.get(search.capacity)
            rows.append([
                c.arrival, f"{c.slo_scale:g}", c.seed, s, f"{search.capacity:g}",
                "-" if search.missed_at is None else f"{search.missed_at:g}",
                "-" if at_capacity is None else f"{at_capacity:.3f}",
                "-" if point is None else f"{point.goodput_per_s:.3g}",
                ", ".join(_probe(r, a, c.capacity[s].unplaced[r]) for r, a in search.probes),
                "-" if scan.num_gpus is None else scan.num_gpus,
                ", ".join(_probe(n, a, scan.unplaced[n]) for n, a in scan.probes)])
    return headers, rows


def _probe(x: float, attainment: float, unplaced: Sequence[str]) -> str:
    return f"{x:g}: {attainment:.3f}" + (f" [{', '.join(unplaced)}]" if unplaced else "")


def _verdicts(cells: Sequence[Cell]) -> list[str]:
    """Where fineslab's capacity and GPU count win, tie and lose, cell by cell (seed means)."""
    lines = []
    for arrival in ARRIVALS:
        for slo in SLO_SCALES:
            ours = _mean_capacity(cells, "fineslab", arrival, slo)
            ours_gpus = _mean_gpus(cells, "fineslab", arrival, slo)
            parts = []
            for baseline in ("prism", "static"):
                theirs = _mean_capacity(cells, baseline, arrival, slo)
                word = "above" if ours > theirs else "below" if ours < theirs else "ties"
                parts.append(f"capacity {word} {baseline} ({ours:g} vs {theirs:g})")
                theirs_gpus = _mean_gpus(cells, baseline, arrival, slo)
                parts.append(f"GPUs for 99% {_gpu_word(ours_gpus, theirs_gpus)} {baseline}'s "
                             f"({_gpu_text(ours_gpus)} vs {_gpu_text(theirs_gpus)})")
            lines.append(f"- {arrival}, SLO scale {slo:g}: fineslab's " + "; ".join(parts))
    return lines


def _gpu_word(ours: float | None, theirs: float | None) -> str:
    if ours == theirs:
        return "equal to"
    if theirs is None or (ours is not None and ours < theirs):
        return "fewer than"
    return "more than"


def _gpu_text(gpus: float | None) -> str:
    return "none within the scan" if gpus is None else f"{gpus:g}"


def _caveats(cells: Sequence[Cell], cfg: CapacityConfig) -> list[str]:
    lines = []
    for c in cells:
        for s in SYSTEM_NAMES:
            found, where = c.capacity[s], f"{s}, {c.arrival}, SLO {c.slo_scale:g}, seed {c.seed}"
            search = found.search
            if search.capacity == 0:
                lines.append(f"- {where}: misses {TARGET:.0%} even at rate scale "
                             f"{cfg.start_rate_scale:g}, the lowest tried: capacity 0.")
            if search.missed_at is None:
                lines.append(f"- {where}: meets the target up to the ceiling "
                             f"{cfg.ceiling_rate_scale:g}; its capacity is at least that.")
            cliff = () if search.missed_at is None else found.unplaced[search.missed_at]
            if cliff and search.capacity > 0 and not found.unplaced[search.capacity]:
                lines.append(f"- {where}: at the miss (rate scale {search.missed_at:g}) the "
                             f"placer could not place {', '.join(cliff)}: a placement cliff.")
            rising = against_trend(search.probes, falling=True)
            if rising is not None:
                lines.append(f"- {where}: attainment rose with rate ({rising}).")
            falling = against_trend(c.gpus[s].probes, falling=False)
            if falling is not None:
                lines.append(f"- {where}: attainment fell as GPUs were added ({falling}).")
            if c.gpus[s].num_gpus == cfg.min_gpus:
                lines.append(f"- {where}: meets {TARGET:.0%} at {cfg.min_gpus} GPUs, the "
                             "scan's first count; fewer might too.")
            if c.gpus[s].num_gpus is None:
                lines.append(f"- {where}: misses {TARGET:.0%} at every GPU count from "
                             f"{cfg.min_gpus} to {cfg.max_gpus}.")
    return lines or ["- None: every search bracketed its threshold, every attainment "
                     "followed its trend."]


def against_trend(probes: Sequence[tuple[float, float]], falling: bool) -> str | None:
    """The first two probes (by x) whose attainments run against the expected trend (falling
    with rate, rising with GPUs) by more than TREND_SLACK, as "x1: a1 -> x2: a2"; None if none."""
    for (x1, a1), (x2, a2) in itertools.combinations(sorted(probes), 2):
        if (a2 - a1 if falling else a1 - a2) > TREND_SLACK:
            return f"{x1:g}: {a1:.3f} -> {x2:g}: {a2:.3f}"
    return None


def seeds_text(seeds: Sequence[int]) -> str:
    """"seed 0" or "seeds 0, 1", for a report's reproduce line."""
    return ("seeds " if len(seeds) > 1 else "seed ") + ", ".join(map(str, seeds))


def _body(cfg: CapacityConfig, cells: Sequence[Cell], figures: dict[str, float],
          wall_s: float) -> str:
    command = "python -m fineslab.sim capacity" + (" --quick" if cfg.quick else "")
    seeds = seeds_text(cfg.seeds)
    return "\n".join([
        "# Capacity: the largest rate at 99% SLO attainment, and GPUs for 99%", "",
        f"Reproduce: `{command}` ({seeds}{', one seed in --quick' if cfg.quick else ''}; "
        f"{cfg.duration_s:g} s of arrivals per probe; bisection from rate scale "
        f"{cfg.start_rate_scale:g}, doubling to at most {cfg.ceiling_rate_scale:g}, to a "
        f"tolerance of {cfg.tolerance:g} in rate scale; {wall_s:.0f} s wall for this run). "
        "Method and caveats: the module docstring of `fineslab/sim/experiments/capacity.py`.",
        "",
        f"- Capacity: fig10's fleet (its {len(cfg.rate_mix)}-model mix on {cfg.num_gpus} "
        "H100s); rate scale 1 is fig10's base rates. Capacity c means attainment >= 0.99 at "
        "rate scale c and < 0.99 at the 'missed at' probe, at most one tolerance above.",
        f"- GPUs for 99% (Prism's metric): fig11's fleet (the {len(cfg.gpu_mix)}-model Table 3 "
        f"mix) at rate "
        f"scale {GPU_RATE_SCALE:g}, GPU count {cfg.min_gpus} to {cfg.max_gpus}, one at a time.",
        "", "## Figures (headline: `<system>_capacity`, Poisson, SLO scale 5; means over seeds)",
        "",
        "```json", str(figures), "```", "",
        "## Where fineslab wins and loses", "", *_verdicts(cells), "",
        "## Means over seeds", "", markdown_table(*_mean_rows(cells)), "",
        "## Every search (system x workload x SLO scale x seed)", "",
        markdown_table(*_cell_rows(cells)), "",
        "## Caveats found in this run", "", *_caveats(cells, cfg), ""])

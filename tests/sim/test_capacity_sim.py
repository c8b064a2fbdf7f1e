"""The capacity experiment (fineslab.sim.experiments.capacity): bisection, GPU scan, report.

The bisection is checked on fake attainment functions with a known threshold; the rest on real
simulator runs of a tiny fleet: two Llama-3.1-8B variants (FP16, FP8) at 1 req/s each at rate
scale 1, on one H100, a few seconds of Poisson arrivals (at SLO scale 5 every system meets 99%
at rate scale 8 and misses it at 16).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from fineslab.sim.__main__ import build_parser
from fineslab.sim.config import SYSTEMS, SimConfig
from fineslab.sim.experiments.capacity import (
    ARRIVALS,
    SLO_SCALES,
    SYSTEM_NAMES,
    TARGET,
    CapacityConfig,
    Cell,
    GpuScan,
    Search,
    SystemCapacity,
    acceptance,
    against_trend,
    bisect_capacity,
    gpus_needed,
    run_capacity,
    system_capacity,
)
from fineslab.sim.experiments.common import MixEntry, PointSpec, Traces, run_point
from fineslab.workload import AZURE_CONV, SHAREGPT_STATS

TRACES = Traces(SHAREGPT_STATS, AZURE_CONV)
MIX = (MixEntry("llama-3.1-8b", "fp16", 1.0), MixEntry("llama-3.1-8b", "fp8", 1.0))
BASE = PointSpec(MIX, 1, 5.0, 1.0, "poisson", 8.0, seed=0)


def _tiny(tmp_path: Path, **overrides: object) -> CapacityConfig:
    fields: dict[str, object] = dict(duration_s=8.0, seeds=(0,), tolerance=1.0, rate_mix=MIX,
                                     num_gpus=1, gpu_mix=MIX, min_gpus=1, max_gpus=2)
    fields.update(overrides)
    return CapacityConfig(tmp_path, TRACES, **fields)  # type: ignore[arg-type]


def _step(threshold: float) -> Callable[[float], float]:
    """A monotone attainment: 1.0 up to `threshold` (inclusive), 0.5 above it."""
    return lambda rate: 1.0 if rate <= threshold else 0.5


@pytest.mark.parametrize("threshold", [1.0, 4.0, 5.3, 7.99, 33.3])
@pytest.mark.parametrize("tolerance", [0.125, 1.0])
def test_bisection_brackets_a_monotone_threshold_to_the_tolerance(threshold: float,
                                                                  tolerance: float) -> None:
    search = bisect_capacity(_step(threshold), 1.0, tolerance, 64.0)
    assert search.missed_at is not None
    assert search.capacity <= threshold < search.missed_at, "the threshold lies in [lo, hi)"
    assert search.missed_at - search.capacity <= tolerance, "the bracket is within tolerance"
    # doublings to the bracket, then halvings of it: log2 bounds on the probes.
    assert len(search.probes) <= math.ceil(math.log2(64)) + 1 + math.ceil(
        math.log2(threshold / tolerance + 1)) + 1, "bisection, not a scan"


def test_every_probe_that_met_is_at_or_below_the_capacity_and_every_miss_above() -> None:
    search = bisect_capacity(_step(5.3), 1.0, 0.125, 64.0)
    assert all(r <= search.capacity for r, a in search.probes if a >= TARGET)
    assert all(r > search.capacity for r, a in search.probes if a < TARGET)


def test_bisection_reports_zero_when_even_the_start_misses() -> None:
    search = bisect_capacity(lambda rate: 0.98, 1.0, 0.25, 64.0)
    assert search.capacity == 0.0 and search.missed_at == 1.0
    assert search.probes == ((1.0, 0.98),), "one probe: nothing lower is tried"


def test_with_a_floor_a_missed_start_is_followed_down_and_bracketed() -> None:
    search = bisect_capacity(_step(0.3), 1.0, 0.05, 64.0, floor=0.25)
    assert [r for r, _ in search.probes][:3] == [1.0, 0.5, 0.25], "halved from the start"
    assert search.missed_at is not None
    assert search.capacity <= 0.3 < search.missed_at <= search.capacity + 0.05
    # negative control: without the floor the same attainment ends at the start, capacity 0
    assert bisect_capacity(_step(0.3), 1.0, 0.05, 64.0).capacity == 0.0


def test_with_a_floor_nothing_met_down_to_it_is_capacity_zero() -> None:
    search = bisect_capacity(lambda rate: 0.5, 1.0, 0.25, 64.0, floor=0.25)
    assert search.capacity == 0.0 and search.missed_at == 0.25
    assert [r for r, _ in search.probes] == [1.0, 0.5, 0.25], "not below the floor"
    with pytest.raises(ValueError, match="floor"):
        bisect_capacity(lambda rate: 1.0, 1.0, 0.25, 64.0, floor=2.0)


def test_bisection_stops_at_the_ceiling_when_every_rate_meets() -> None:
    search = bisect_capacity(lambda rate: 1.0, 1.0, 0.25, 10.0)
    assert search.capacity == 10.0 and search.missed_at is None
    assert [r for r, _ in search.probes] == [1.0, 2.0, 4.0, 8.0, 10.0]


def test_bisection_rejects_a_meaningless_bracket() -> None:
    with pytest.raises(ValueError, match="tolerance"):
        bisect_capacity(lambda rate: 1.0, 1.0, 0.0, 64.0)
    with pytest.raises(ValueError, match="start"):
        bisect_capacity(lambda rate: 1.0, 0.0, 0.25, 64.0)


def test_against_trend_names_a_rise_with_rate_and_a_fall_with_gpus() -> None:
    assert against_trend([(4.0, 0.99), (8.0, 0.95), (6.0, 0.97)], falling=True) is None
    assert against_trend([(4.75, 0.823), (5.0, 0.876)], falling=True) == "4.75: 0.823 -> 5: 0.876"
    assert against_trend([(6, 0.927), (7, 0.910)], falling=False) == "6: 0.927 -> 7: 0.910"
    assert against_trend([(6, 0.927), (7, 0.920)], falling=False) is None, "within the slack"


def test_a_capacity_meets_the_target_and_the_miss_above_it_does_not(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path)
    found = system_capacity(BASE, SYSTEMS["fineslab"], cfg, SimConfig())
    search = found.search
    assert set(found.unplaced) == {r for r, _ in search.probes}, "placement kept per probe"
    assert search.capacity >= cfg.start_rate_scale and search.missed_at is not None
    assert search.missed_at - search.capacity <= cfg.tolerance

    def attainment(rate_scale: float) -> float:
        spec = PointSpec(MIX, 1, 5.0, rate_scale, "poisson", 8.0, seed=0)
        (point,) = run_point(spec, [SYSTEMS["fineslab"]], TRACES, SimConfig())
        return point.attainment

    assert attainment(search.capacity) >= TARGET, "a fresh run at the capacity meets 99%"
    assert attainment(search.missed_at) < TARGET, "a fresh run just above the bracket misses"


def test_an_impossible_slo_gives_capacity_zero(tmp_path: Path) -> None:
    impossible = PointSpec(MIX, 1, 5.0, 1.0, "poisson", 8.0, seed=0,
                           slo_overrides_s=tuple((e.name, 1e-6) for e in MIX))
    search = system_capacity(impossible, SYSTEMS["fineslab"], _tiny(tmp_path),
                             SimConfig()).search
    assert search.capacity == 0.0 and search.missed_at == 1.0, "no rate meets a 1 us TTFT SLO"


def test_the_gpu_scan_stops_each_system_at_its_first_count_that_meets(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, max_gpus=3)
    # Rate scale 16 at SLO 20: one GPU misses for Static* only (0.65), two serve everyone.
    base = PointSpec(MIX, 1, 20.0, 16.0, "poisson", 8.0, seed=0)
    scans = gpus_needed(base, SYSTEM_NAMES, cfg, SimConfig())
    for system, scan in scans.items():
        assert scan.num_gpus is not None, f"{system} meets 99% within 3 GPUs"
        assert scan.probes[-1][0] == scan.num_gpus, f"{system}: the scan stops at its count"
        assert scan.probes[-1][1] >= TARGET, f"{system}: the count reported meets the target"
        assert all(a < TARGET for _, a in scan.probes[:-1]), f"{system}: fewer GPUs miss"
    assert scans["static"].num_gpus == 2 and scans["fineslab"].num_gpus == 1


def test_the_experiment_reports_every_cell_and_the_json_keys(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, duration_s=4.0, tolerance=8.0, ceiling_rate_scale=16.0)
    figures, text = run_capacity(cfg, SimConfig())
    for key in ("fineslab_capacity", "prism_capacity", "static_capacity",
                "fineslab_over_prism", "fineslab_over_static"):
        assert key in figures, f"the issue's headline key {key}"
    assert figures["fineslab_over_prism"] == pytest.approx(
        figures["fineslab_capacity"] / figures["prism_capacity"], abs=1e-4)
    for arrival in ARRIVALS:
        for slo in SLO_SCALES:
            for system in SYSTEM_NAMES:
                assert f"{system}_capacity_{arrival}_slo{slo:g}" in figures
    json.dumps(figures, allow_nan=False)  # one strict JSON line: no NaN or Infinity
    for system in SYSTEM_NAMES:  # goodput beside attainment (issue #39): req/s meeting the SLO
        assert figures[f"{system}_goodput_per_s"] > 0, f"{system} met its SLO at its capacity"
    report = (tmp_path / "capacity.md").read_text()
    assert "goodput at capacity (req/s)" in report
    rows = [line for line in report.splitlines() if line.startswith(("| poisson |",
                                                                      "| replay |"))]
    cells = len(ARRIVALS) * len(SLO_SCALES) * len(cfg.seeds)
    assert len(rows) == cells + cells * len(SYSTEM_NAMES), "a mean row per cell, a row per search"
    assert "tolerance of 8" in report and "4 s of arrivals" in report
    assert "fineslab capacity" in text


def _cell(arrival: str, slo: float, seed: int, capacity: dict[str, float],
          gpus: dict[str, int | None]) -> Cell:
    return Cell(arrival, slo, seed,
                {s: SystemCapacity(Search(c, c + 1, ((c, 1.0),)), {}, {})
                 for s, c in capacity.items()},
                {s: GpuScan(n, (), {}) for s, n in gpus.items()})


def test_the_headline_averages_seeds_and_leaves_out_what_has_no_number(tmp_path: Path) -> None:
    cells = [_cell(arrival, slo, seed,
                   {"fineslab": 4.0 + seed, "prism": 0.0, "static": 2.0},
                   {"fineslab": 8 + seed, "prism": None if seed else 9, "static": 10})
             for arrival in ARRIVALS for slo in SLO_SCALES for seed in (0, 1)]
    figures = acceptance(cells, _tiny(tmp_path, seeds=(0, 1)))
    assert figures["fineslab_capacity"] == 4.5, "the mean of seeds 0 (4) and 1 (5)"
    assert figures["fineslab_over_static"] == 2.25
    assert "fineslab_over_prism" not in figures, "prism's capacity 0 has no finite ratio"
    assert figures["fineslab_gpus_for_99_poisson_slo5"] == 8.5
    assert "prism_gpus_for_99_poisson_slo5" not in figures, "seed 1 met 99% at no GPU count"
    assert figures["num_seeds"] == 2.0
    json.dumps(figures, allow_nan=False)


def test_the_cli_has_a_capacity_command() -> None:
    args = build_parser().parse_args(["capacity", "--quick", "--json", "--seed", "3"])
    assert args.command == "capacity" and args.quick and args.json and args.seed == 3
    assert args.func.__name__ == "_capacity"

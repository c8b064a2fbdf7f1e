"""Capacity by part and under memory pressure (fineslab.sim.experiments.capacity_parts): every
part and fraction searched, the JSON keys, the report's reading of each miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fineslab.sim.__main__ import build_parser
from fineslab.sim.config import SimConfig
from fineslab.sim.experiments.capacity import CapacityConfig, Search, SystemCapacity
from fineslab.sim.experiments.capacity_parts import (
    MEMORY_FRACTIONS,
    MEMORY_SYSTEMS,
    PARTS,
    SLO_SCALES,
    Found,
    run_parts,
    what_broke,
)
from fineslab.sim.experiments.common import MixEntry, PointResult, PointSpec, Traces
from fineslab.workload import AZURE_CONV, SHAREGPT_STATS

MIX = (MixEntry("llama-3.1-8b", "fp16", 1.0), MixEntry("llama-3.1-8b", "fp8", 1.0))


def test_every_part_and_fraction_is_searched_and_reported(tmp_path: Path) -> None:
    cfg = CapacityConfig(tmp_path, Traces(SHAREGPT_STATS, AZURE_CONV), duration_s=4.0,
                         seeds=(0,), tolerance=8.0, ceiling_rate_scale=16.0, rate_mix=MIX,
                         num_gpus=1)
    slo_scales, fractions = (5.0, 20.0), (0.9, 0.7)  # the CLI's are SLO_SCALES, MEMORY_FRACTIONS
    figures, text = run_parts(cfg, SimConfig(), slo_scales, fractions)
    for slo in slo_scales:
        for part in PARTS:
            assert f"{part.name}_capacity_slo{slo:g}" in figures
    for fraction in fractions:
        for system in MEMORY_SYSTEMS:
            assert f"{system}_capacity_mem{fraction:g}" in figures
        if figures[f"static_capacity_mem{fraction:g}"] > 0:
            assert figures[f"fineslab_over_static_mem{fraction:g}"] == pytest.approx(
                figures[f"fineslab_capacity_mem{fraction:g}"]
                / figures[f"static_capacity_mem{fraction:g}"], abs=1e-4)
    # The parts table's Static* and fineslab columns are the memory sweep's at 0.9: one setup.
    assert figures["static_capacity_slo5"] == figures["static_capacity_mem0.9"]
    assert figures["fineslab_capacity_slo5"] == figures["fineslab_capacity_mem0.9"]
    json.dumps(figures, allow_nan=False)
    report = (tmp_path / "capacity-parts.md").read_text()
    searches = len(slo_scales) * len(PARTS) + len(fractions) * len(MEMORY_SYSTEMS)
    rows = [line for line in report.splitlines()
            if line.startswith(tuple(f"| {name} |" for name in
                                     {*(p.name for p in PARTS), *MEMORY_SYSTEMS}))]
    assert len(rows) == searches, "one row per search"
    assert "+alg2 capacity" in text and "fineslab / static" in text


def _found(by_model: dict[str, float], dropped: int, unplaced: tuple[str, ...],
           missed: float | None = 3.0) -> Found:
    spec = PointSpec(MIX, 1, 5.0, 3.0, "poisson", 4.0)
    point = PointResult("static", spec, 0.9, 0.0, 0.0, 100, dropped, unplaced, by_model)
    search = Search(2.0, missed, ((2.0, 1.0), (3.0, 0.9)))
    return Found("static", 5.0, 0.9, 0, SystemCapacity(search, {}, {3.0: point}))


def test_the_sweeps_must_hold_the_headline_cell(tmp_path: Path) -> None:
    cfg = CapacityConfig(tmp_path, Traces(SHAREGPT_STATS, AZURE_CONV))
    with pytest.raises(ValueError, match="must include"):
        run_parts(cfg, SimConfig(), (2.0,), MEMORY_FRACTIONS)
    with pytest.raises(ValueError, match="must include"):
        run_parts(cfg, SimConfig(), SLO_SCALES, (0.7,))


def test_what_broke_names_the_worst_models_the_drops_and_what_was_unplaced() -> None:
    text = what_broke(_found({"a": 0.99, "b": 0.5, "c": 0.8}, 7, ("d", "d")))
    assert text == "at 3: b 0.500, c 0.800; 7/100 dropped; unplaced d"
    assert what_broke(_found({"a": 0.9}, 0, ())) == "at 3: a 0.900"
    assert what_broke(_found({}, 0, (), missed=None)) == "met to the ceiling"


def test_the_cli_has_a_capacity_parts_command() -> None:
    args = build_parser().parse_args(["capacity-parts", "--quick", "--json"])
    assert args.command == "capacity-parts" and args.func.__name__ == "_capacity_parts"

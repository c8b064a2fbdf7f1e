"""Which fleets `python -m fineslab.bench.capacity` runs, without running one: the
`fineslab-margin` system (issue #38) is chosen only by --systems, its fleet is fineslab's with
the margin peer of its policy, and its figures sit beside fineslab's. The live run:
tests/serving/test_capacity_bench.py (slow)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fineslab.scheduler.local import get_batch_policy, margin_of

from fineslab.bench.capacity import (
    QUICK,
    SIM_SYSTEMS,
    SYSTEMS,
    Calibration,
    CapacityBenchConfig,
    _names,
    fleet_config,
    summarize,
)
from fineslab.fleet.config import fleet_from_dict


def test_the_margin_system_runs_only_when_asked_for() -> None:
    assert CapacityBenchConfig().systems == ("fineslab", "fineslab-router", "shared-fcfs",
                                             "static"), "the default grid is unchanged"
    assert "fineslab-margin" not in QUICK.systems
    parse = _names(SYSTEMS, "systems")
    assert parse("fineslab,fineslab-margin") == ("fineslab", "fineslab-margin")
    with pytest.raises(argparse.ArgumentTypeError):
        parse("fineslab,fineslab-margins")


@pytest.mark.parametrize(("system", "policy", "local"), [
    ("fineslab", "adaptive-early-shed", "engine"),
    ("fineslab-router", "adaptive-early-shed", "router"),
    ("fineslab-margin", "adaptive-early-shed-margin", "engine"),
    ("shared-fcfs", "fcfs", "router"),
    ("static", "fcfs", "router")])
def test_each_system_is_its_fleet_of_the_same_models(system: str, policy: str,
                                                     local: str) -> None:
    config = fleet_config(CapacityBenchConfig(), system, f"t{system[:6]}", None)
    assert (config["batch_policy"], config["local_scheduler"]) == (policy, local)
    fleet = fleet_from_dict(config, "capacity")
    assert [m.name for m in fleet.models] == [m.name for m in CapacityBenchConfig().mix]
    assert (margin_of(get_batch_policy(policy)) is not None) == (system == "fineslab-margin")
    assert system in SIM_SYSTEMS


def _cell(capacities: dict[str, float]) -> dict[str, object]:
    return {"workload": "shift", "seed": 0,
            "systems": {name: {"capacity": c, "sim_capacity": c}
                        for name, c in capacities.items()}}


def test_the_margin_system_is_reported_against_fineslab_by_cell() -> None:
    calibration = Calibration({}, {"m": Path("p")}, {"m": 1.0}, 1.0, {"m": 0.25})
    cfg = CapacityBenchConfig(systems=("fineslab", "fineslab-margin", "static"))
    out = summarize(cfg, calibration, {}, [_cell({"fineslab": 1.0, "fineslab-margin": 1.5,
                                                  "static": 2.0})], 1.0)
    assert out["fineslab_margin_capacity"] == 1.5
    assert out["margin_over_fineslab_by_cell"] == {"shift-0": 1.5}
    assert out["fineslab_over_best_baseline"] == 0.5
    without = summarize(CapacityBenchConfig(), calibration, {},
                        [_cell({"fineslab": 1.0, "static": 2.0})], 1.0)
    assert without["fineslab_margin_capacity"] is None
    assert without["margin_over_fineslab_by_cell"] == {}

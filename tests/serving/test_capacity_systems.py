"""Which fleets `python -m fineslab.bench.capacity` runs, without running one: the
`fineslab-margin` system (issue #38) is chosen only by --systems, its fleet is fineslab's with
the margin peer of its policy, and its figures sit beside fineslab's. The live run:
tests/serving/test_capacity_bench.py (slow)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
from fineslab.scheduler.local import get_batch_policy, margin_of
from fineslab.scheduler.profile_schema import load_profile

from fineslab.bench.capacity import (
    QUICK,
    SIM_SYSTEMS,
    SYSTEMS,
    Calibration,
    CapacityBenchConfig,
    _names,
    config_from_dict,
    fleet_config,
    main,
    resimulate,
    sim_searches,
    summarize,
)
from fineslab.fleet.config import fleet_from_dict

REPO = Path(__file__).resolve().parents[2]


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


def _stored_run(folder: Path) -> tuple[Path, CapacityBenchConfig, Calibration]:
    """A stored `--json` run (a table, then the JSON line) of two systems on one cell, its
    profiles the stored llama-tiny CPU profile under each mix name."""
    profile = load_profile(REPO / "profiles" / "llama-tiny--bf16--cpu.json")
    cfg = replace(CapacityBenchConfig(), workloads=("shift",), seeds=(0,), duration_s=6.0,
                  tolerance=1.0, ceiling=4.0, systems=("fineslab", "static"), cpu_cores=2)
    names = [m.name for m in cfg.mix]
    calibration = Calibration({n: profile for n in names}, {}, dict.fromkeys(names, 0.5), 10.0,
                              {m.name: 2.0 * m.weight for m in cfg.mix})
    cells = [{"workload": "shift", "seed": 0,
              "systems": {"fineslab": {"capacity": 2.0, "sim_capacity": 7.0},
                          "static": {"capacity": 0.0, "sim_capacity": 7.0}}}]
    out = summarize(cfg, calibration, {}, cells, 1.0)
    path = folder / "run.json"
    path.write_text("a table\n" + json.dumps(out) + "\n")
    return path, cfg, calibration


def test_a_stored_run_is_simulated_again_from_its_own_config_and_profiles(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, cfg, calibration = _stored_run(tmp_path)
    stored = json.loads(path.read_text().splitlines()[-1])
    assert config_from_dict(stored["config"]) == cfg, "the config survives its JSON"
    again = resimulate(path)
    direct = sim_searches(cfg, calibration, "shift", 0, cfg.arena_mib << 20)
    (cell,) = again["cells"]
    for name, s in cell["systems"].items():
        assert s["sim_capacity"] == direct[name].results()[0.99].capacity, name
        assert s["stored_sim_capacity"] == 7.0 and s["capacity"] == stored["cells"][0][
            "systems"][name]["capacity"]
    fineslab = cell["systems"]["fineslab"]
    assert fineslab["error"] == round(abs(fineslab["sim_capacity"] - 2.0) / 2.0, 3)
    assert cell["systems"]["static"]["error"] is None, "no relative error from a zero"
    assert again["sim_capacity_error"] == fineslab["error"] and again["cpu_cores"] == 2
    capsys.readouterr()
    assert main(["--resimulate", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == again
    assert resimulate(path, cpu_cores=1)["cpu_cores"] == 1, "--cpu-cores overrides the run's"


@pytest.mark.parametrize("text", ["", "not json\n", '{"cells": []}\n'])
def test_a_file_that_is_no_stored_run_is_a_one_line_error(
        tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["--resimulate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "recorded its profiles" in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert main(["--resimulate", str(tmp_path / "missing.json")]) == 2


def test_a_stored_run_with_a_malformed_cell_is_a_one_line_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = _stored_run(tmp_path)
    stored = json.loads(path.read_text().splitlines()[-1])
    del stored["cells"][0]["systems"]["static"]["sim_capacity"]
    path.write_text(json.dumps(stored) + "\n")
    assert main(["--resimulate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "malformed cell" in err[-1], err

"""Select-N's SLO sweep (fineslab/sim/experiments/selectn.py): report, numbers, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fineslab.sim.__main__ import main
from fineslab.sim.experiments.selectn import (
    OPT_6_7B,
    QUICK_DELTAS,
    SelectNExpConfig,
    run_selectn,
    sweep,
)


def test_the_sweep_writes_a_report_beside_the_papers_numbers(tmp_path: Path) -> None:
    acceptance, text = run_selectn(SelectNExpConfig(tmp_path, quick=True))
    report = (tmp_path / "selectn.md").read_text()
    assert "### Beside the paper" in report and "### Why they differ" in report
    assert acceptance["paper_decode_interval_d0.5"] == 8.0
    assert acceptance["max_latency_over_slo"] <= 1.0, "every chosen interval meets its SLO"
    assert all(math.isfinite(v) for v in acceptance.values())
    assert text in report


def test_a_looser_slo_never_keeps_more_layers_resident() -> None:
    points = sweep(OPT_6_7B, "decode", 128, 64, QUICK_DELTAS)
    offloaded = [p.layers_offloaded for p in points]
    assert offloaded == sorted(offloaded), f"layers offloaded by delta: {offloaded}"
    assert offloaded[-1] > offloaded[0], "control: the sweep is not flat"


def test_the_cli_runs_selectn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selectn", "--quick", "--out", str(tmp_path), "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["paper_prefill_interval_d0.5"] == 3.0

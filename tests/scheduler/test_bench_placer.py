"""The placer benchmark runs and its JSON line carries one timing key per placer."""

from __future__ import annotations

import json

import pytest

from fineslab.bench import placer


def test_bench_placer_json_has_every_placer(capsys: pytest.CaptureFixture[str]) -> None:
    assert placer.main(["--models", "20", "--gpus", "8", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("mme", "mme_exact", "kvpr", "static"):
        assert 0 < result[f"{key}_seconds"] < 5, f"{key} timing missing or absurd"
        assert result[f"{key}_replicas"] + result[f"{key}_unplaced"] >= 20

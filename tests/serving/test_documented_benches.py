"""The documented benchmarks no other test ran (#39: every command the docs show runs in a test),
each as a user runs it (`python -m ...`, real SGLang), cut to its quick form: `bench.start` with
one start of each kind, `bench.pool` with one round of two short requests (`bench.cluster`:
tests/cluster/test_cluster_fleet.py). The figures themselves are measured in the docs' runs
(docs/serving.md, docs/plugin.md); here each must be there and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _run(model_cache: Path, *args: str, timeout_s: float = 900) -> dict[str, Any]:
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache))
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict), done.stdout[-1000:]
    return figures


def test_the_start_benchmark_times_plain_warm_and_restarted_runtimes(
        model_cache: Path, tmp_path: Path) -> None:
    # docs/serving.md: python -m fineslab.bench.start --json --repeats 3
    figures = _run(model_cache, "fineslab.bench.start", "--json", "--repeats", "1",
                   "--logs", str(tmp_path))
    for key in ("cold_start_s", "warm_start_s", "restart_s", "restart_plain_s"):
        spread = figures[key]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"], (key, spread)
    assert figures["ratio"] > 1, f"a warm start is faster than a plain one: {figures}"
    assert figures["pss_mib_per_runtime"]["warm"] > 0 and figures["zygote_ready_s"] > 0


def test_the_pool_benchmark_compares_the_slab_pool_with_sglangs_own(
        model_cache: Path, tmp_path: Path) -> None:
    # docs/plugin.md: python -m fineslab.bench.pool --json --rounds 4 --requests 8 ...
    figures = _run(model_cache, "fineslab.bench.pool", "--json", "--device", "cpu",
                   "--rounds", "1", "--requests", "2", "--new-tokens", "8",
                   "--logs", str(tmp_path))
    assert figures["device"] == "cpu"
    assert figures["plugin_tok_s"] > 0 and figures["stock_tok_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["plugin_tok_s"] / figures["stock_tok_s"],
                                             rel=0.01), "one round: its ratio"
    for key in ("plugin_tok_s_spread", "stock_tok_s_spread", "ratio_spread"):
        assert figures[key]["n"] == 1 and figures[key]["min"] == figures[key]["max"], figures

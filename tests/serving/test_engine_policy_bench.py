"""`python -m fineslab.bench.engine_policy --quick --json --duration 3`: the benchmark's short
version, one CPU model launched three times (SGLang's own batching, the router's gate, the gate
and the engine policy; the fourth mode, the engine policy without its refresh, is left to the
benchmark itself) under the same requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_benchmark_sends_the_same_requests_to_three_modes_and_fails_none(
        model_cache: Path) -> None:
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache))
    done = subprocess.run([sys.executable, "-m", "fineslab.bench.engine_policy", "--quick",
                           "--json", "--duration", "3", "--modes", "engine,router,sglang"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    modes = figures["modes"]
    assert set(modes) == {"sglang", "router", "engine"} and figures["rate_per_s"] > 0
    counts = {mode: f["requests"] for mode, f in modes.items()}
    assert len(set(counts.values())) == 1 and counts["engine"] > 0, counts
    for mode, f in modes.items():
        assert f["failed"] == 0, (mode, f)
        assert f["completed"] + f["dropped"] == f["requests"], (mode, f)
        assert 0.0 <= f["attainment"] <= 1.0 and f["attainment"] == figures[f"attainment_{mode}"]
    assert modes["sglang"]["dropped"] == 0, "fcfs at the router drops nothing"
    assert modes["sglang"]["engine_drops"] == modes["router"]["engine_drops"] == 0

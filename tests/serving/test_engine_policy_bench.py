"""`python -m fineslab.bench.engine_policy --quick --json --duration 3 --modes engine,sglang`: the
benchmark's short version, one CPU model launched twice (SGLang's own batching, then the
router's gate with the engine policy) under the same requests. The other two modes (the router's
gate alone, the engine policy without its refresh) launch the same fleet with other settings,
and are left to the benchmark itself: each would add a fleet's start-up to the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_benchmark_sends_the_same_requests_to_each_mode_and_fails_none(
        model_cache: Path) -> None:
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache))
    done = subprocess.run([sys.executable, "-m", "fineslab.bench.engine_policy", "--quick",
                           "--json", "--duration", "3", "--modes", "engine,sglang"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    modes = figures["modes"]
    assert figures["order"] == ["sglang", "engine"] and set(modes) == {"sglang", "engine"}
    assert figures["rate_per_s"] > 0
    counts = {mode: f["requests"] for mode, f in modes.items()}
    assert len(set(counts.values())) == 1 and counts["engine"] > 0, counts
    for mode, f in modes.items():
        assert f["failed"] == 0, (mode, f)
        assert f["completed"] + f["dropped"] == f["requests"], (mode, f)
        assert 0.0 <= f["attainment"] <= 1.0 and f["attainment"] == figures[f"attainment_{mode}"]
    assert modes["sglang"]["dropped"] == 0, "fcfs at the router drops nothing"
    assert modes["sglang"]["engine_drops"] == 0, "no engine policy in SGLang's own batching"
    assert all(len(f["rounds"]) == 1 and f["attainment_spread"]["n"] == 1
               for f in modes.values())


def _round(attainment: float, requests: int = 10) -> dict[str, object]:
    return {"requests": requests, "completed": requests, "dropped": 0, "failed": 0,
            "engine_drops": 1, "attainment": attainment, "goodput_per_s": attainment,
            "ttft_p50_s": 0.1, "ttft_p99_s": None, "slo_s": 1.0}


def test_a_modes_rounds_are_medians_with_their_spread_and_counts_summed() -> None:
    from fineslab.bench.engine_policy import summarize_mode

    mode = summarize_mode([_round(0.5), _round(0.9), _round(0.7)])
    assert mode["attainment"] == 0.7
    assert mode["attainment_spread"] == {"median": 0.7, "min": 0.5, "max": 0.9, "n": 3}
    assert mode["requests"] == mode["completed"] == 30 and mode["engine_drops"] == 3
    assert mode["ttft_p99_s"] is None and "ttft_p99_s_spread" not in mode, "none measured"
    assert len(mode["rounds"]) == 3

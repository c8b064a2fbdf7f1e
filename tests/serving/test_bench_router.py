"""`python -m fineslab.bench.router --json`: a short run prints the added-latency keys."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_router_reports_added_p50_and_p99() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.bench.router", "--rate", "20", "--duration-s", "2",
         "--json"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"p50_ms", "p99_ms", "router_p99_ms", "direct_p99_ms"} <= set(report)
    assert math.isfinite(report["p50_ms"]) and math.isfinite(report["p99_ms"])
    assert report["failed"] == 0, "every request of the short run succeeds on both paths"
    for key in ("p50_ms", "p99_ms"):  # #38: the median of the windows, with its spread
        figure = report[f"{key}_spread"]
        assert figure["n"] == 3 and figure["min"] <= report[key] <= figure["max"], figure

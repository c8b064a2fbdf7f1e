"""`python -m fineslab.bench.precisions --no-decode --json` prints the capacity and weight figures
issue #19 targets, measured from the checkpoints the writers produce (no servers)."""

from __future__ import annotations

import json
import subprocess
import sys

from fineslab.precisions import FLEET_PRECISIONS


def test_the_benchmark_reports_weight_bytes_and_ratios_from_real_checkpoints() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fineslab.bench.precisions", "--no-decode", "--json",
         "--model", "llama-tiny"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    ratio, total = figures["weight_ratio"], figures["weight_bytes"]
    assert set(ratio) == set(total) == set(FLEET_PRECISIONS)
    assert ratio["bf16"] == ratio["kv4"] == 1.0
    # Linear bytes: fp8 1 + 4/(N K) per weight; awq 1/4 + (2 + 1/2)/(2 G) at G = 64; qoq
    # 1/4 + 1/g + 1/K (g = 128, or 64 where K = 64 does not take 128).
    assert 0.50 <= ratio["fp8"] <= 0.51, ratio
    assert 0.26 <= ratio["awq"] <= 0.28, ratio
    assert 0.25 < ratio["qoq"] <= 0.30, f"issue #19 target: qoq <= 0.30 of bf16: {ratio}"
    assert total["qoq"] < total["fp8"] < total["bf16"], total
    assert figures["kv4_vs_bf16"] >= 3.5 and figures["fp8_vs_bf16"] >= 1.9, figures
    assert "top1" not in figures, "no accuracy without the fleet (--no-decode)"

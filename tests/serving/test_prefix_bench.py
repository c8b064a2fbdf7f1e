"""`python -m fineslab.bench.prefix --quick --json`: the benchmark's short version, two launched
CPU fleets (prefix lending off, then on) under the same multi-turn sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_benchmark_lends_evicted_histories_and_prints_every_figure(
        model_cache: Path) -> None:
    # launches examples/cpu-prefix.yaml twice (its quick form: `fleet_config`), lending off, on
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache))
    done = subprocess.run([sys.executable, "-m", "fineslab.bench.prefix", "--quick", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("ttft_later_turns_p50_off", "ttft_later_turns_p50_on", "ttft_ratio",
                "hit_rate_off", "hit_rate_on", "lender_reclaim_ms", "lender_carve_unlent_ms"):
        assert isinstance(figures[key], float) and figures[key] == figures[key], key  # not NaN
    assert figures["errors_off"] == figures["errors_on"] == 0
    assert figures["lent_slabs_peak"] > 0, "the chat model's evicted histories were lent"
    assert figures["hit_rate_on"] > figures["hit_rate_off"], figures
    assert figures["lender_reclaims"] > 0, "a lender carved lent slabs, so it was timed"
    assert figures["rounds"] == 1 and figures["ttft_ratio_spread"]["n"] == 1


def _run(ttft_s: float, lent: bool) -> dict[str, object]:
    from types import SimpleNamespace

    later = [SimpleNamespace(turn_index=1, ttft_s=ttft_s, prompt_tokens=100,
                             cached_tokens=80 if lent else 20)]
    run: dict[str, object] = {"drive": SimpleNamespace(results=later, errors=[]),
                              "lent_peak": 3 if lent else 0}
    if lent:
        run["carves"] = ([0.001], [0.002], None)
        run["store_carves"] = ([0.001], [0.003])
    return run


def test_rounds_report_the_median_ratio_with_its_spread() -> None:
    """Two rounds whose on/off ratios are 0.4 and 0.6: the ratio is their median, 0.5 (not the
    ratio of the medians, 0.55 / 1.1), with min and max; turns summed, the lent peak the most."""
    from fineslab.bench.prefix import summarize_rounds

    figures = summarize_rounds([_run(1.0, False), _run(1.2, False)],
                               [_run(0.4, True), _run(0.72, True)])
    assert figures["rounds"] == 2
    assert figures["ttft_ratio"] == 0.5
    assert figures["ttft_ratio_spread"] == {"median": 0.5, "min": 0.4, "max": 0.6, "n": 2}
    assert figures["ttft_later_turns_p50_off_spread"]["max"] == 1.2
    assert figures["later_turns_on"] == 2 and figures["lent_slabs_peak"] == 3
    assert figures["hit_rate_on"] == 0.8 and "hit_rate_on_spread" not in figures


def test_the_benchmark_launches_the_documented_example() -> None:
    """examples/cpu-prefix.yaml is the fleet the benchmark runs (#39: every documented command
    is run by a test): its defaults leave the file as it is, lending off only drops it, --quick
    only shrinks it."""
    import yaml

    from fineslab.bench.prefix import EXAMPLE, QUICK, BenchConfig, fleet_config

    example = yaml.safe_load(EXAMPLE.read_text())
    assert fleet_config(BenchConfig(), True, example["fleet_id"]) == example
    off = fleet_config(BenchConfig(), False, "x")
    assert "prefix_lending" not in off["models"][0] and off["models"][1:] == example["models"][1:]
    quick = fleet_config(QUICK, True, "x")
    assert [m["name"] for m in quick["models"]] == ["chat", "idle-llama"]
    assert quick["models"][0]["prefix_lending"] == example["models"][0]["prefix_lending"]

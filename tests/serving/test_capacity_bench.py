"""`python -m fineslab.bench.capacity --quick --json` cut to its least: 16 s probes, rate
scales 1 and 2 only, fineslab and static (two real CPU fleets of three models; the static one
calibrates before its limits are set; shared-fcfs is that fleet without the limits and would
cost the suite a third fleet). Checked: the same requests for each system, every bisection
probe reported, the static KV limits applied, the simulator's capacity beside the live one.
4 s probes offered no request at all on a slower machine (rate scale 1 is a quarter of the
measured saturation throughput). The full grid is in docs/evaluation.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fineslab.sim.experiments.capacity import Bisection

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = {"fineslab", "static"}


def test_the_quick_capacity_run_bisects_each_system_on_the_same_requests(
        model_cache: Path, tmp_path: Path) -> None:
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache))
    kept = tmp_path / "kept" / "logs"
    done = subprocess.run([sys.executable, "-m", "fineslab.bench.capacity", "--quick", "--json",
                           "--duration", "8", "--ceiling", "2", "--tolerance", "1",
                           "--systems", "fineslab,static", "--settle", "0",
                           "--keep-logs", str(kept)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    (cell,) = figures["cells"]
    systems = cell["systems"]
    assert set(systems) == SYSTEMS
    assert figures["saturation_per_s"] > 0 and all(s > 0 for s in figures["slo_s"].values())
    limits = figures["static_kv_limits_bytes"]
    assert set(limits) == set(figures["slo_s"]) and all(v > 0 for v in limits.values())
    assert sum(limits.values()) <= figures["config"]["arena_mib"] << 20, "partitions of the arena"
    requests: dict[float, set[int]] = {}
    for name, s in systems.items():
        probes = s["probes"]
        assert probes and probes[0]["rate_scale"] == 1.0, (name, probes)
        for p in probes:
            requests.setdefault(p["rate_scale"], set()).add(p["requests"])
            assert p["failed"] == 0, f"{name} at {p['rate_scale']}: {p['failures']}"
            assert p["met"] + p["late"] + p["dropped"] + p["timed_out"] == p["requests"], p
            assert p["attainment"] == round(p["met"] / p["requests"], 4), p
            assert 0 <= p["cpu_busy_before"] <= 1 and p["settle_wait_s"] >= 0, p
        # the 99% search replayed over the reported probes: every rate it asks for is there,
        # and it ends where the benchmark's did (attainment need not fall monotonically with
        # the rate on a loaded machine: a miss at x1 and a hit at x2, asked by the 90% search,
        # leaves the 99% search below x1, halving toward the floor)
        replay = Bisection(1.0, 1.0, 2.0, 0.99, figures["config"]["floor"])
        by_rate = {p["rate_scale"]: p["attainment"] for p in probes}
        while (rate := replay.next_rate()) is not None:
            assert rate in by_rate, (name, rate, probes)
            replay.record(by_rate[rate])
        assert s["capacity"] == replay.result().capacity, (name, s["capacity"], probes)
        assert 0 <= s["sim_capacity"] <= 2 and s["sim_probes"], (name, s)
        assert figures[f"{name}_capacity"] == s["capacity"]
    assert all(len(counts) == 1 for counts in requests.values()), \
        f"each rate scale offers every system the same requests: {requests}"
    assert systems["static"]["probes"][0]["engine_drops"] == 0, "fcfs: no engine policy"
    assert figures["shared_fcfs_capacity"] is None, "not asked for: no figure"
    assert figures["fineslab_router_capacity"] is None
    assert figures["engine_over_router_by_cell"] == {}
    assert "sim_capacity_error" in figures and "fineslab_over_best_baseline" in figures
    # --keep-logs: each system's fleet config, launcher output and every runtime's log
    for name in SYSTEMS:
        assert (kept / f"{name}.yaml").is_file() and (kept / f"{name}.out").is_file(), name
        logs = {p.name for p in (kept / f"{name}-logs").glob("*.log")}
        assert logs == {f"{m}-r0.log" for m in figures["slo_s"]}, (name, logs)


def test_a_probe_that_offers_no_request_is_a_clear_error_not_a_traceback() -> None:
    from dataclasses import replace

    from fineslab.bench.capacity import QUICK, workload
    from fineslab.errors import ConfigError

    rates = {m.name: 0.01 for m in QUICK.mix}
    with pytest.raises(ConfigError, match="use a longer --duration"):
        workload(replace(QUICK, duration_s=1.0), "shift", rates, 1.0, 0)
    assert workload(QUICK, "shift", {m.name: 2.0 for m in QUICK.mix}, 1.0, 0), "a real probe"


@pytest.mark.parametrize("value", ["-1", "nan", "4000", "soon"])
def test_a_bad_settle_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fineslab.bench.capacity import main

    with pytest.raises(SystemExit) as exited:
        main(["--settle", value])
    assert exited.value.code == 2 and "--settle" in capsys.readouterr().err

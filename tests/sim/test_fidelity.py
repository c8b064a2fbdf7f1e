"""The fidelity check (issue #18 item 5): the full stack live, a stored HTTP profile simulated.

The fast tests run `run_fidelity` with the live side replaced by the simulator's own summary
(so live == simulated) and read the report; the slow one starts the one-model fleet once,
stores a quick HTTP profile of it and runs a short fidelity workload against it."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
from fineslab.scheduler.profile_schema import load_profile

from fineslab.bench.chaos_fleet import fleet_processes, leftover_files
from fineslab.env import FineslabEnv
from fineslab.fleet.config import fleet_from_dict
from fineslab.models.generate import ensure_model
from fineslab.profile.measure import MeasureConfig
from fineslab.profile.measure_http import fleet_spec, run_measure_http
from fineslab.sim.config import SimConfig
from fineslab.sim.experiments import fidelity
from fineslab.sim.experiments.fidelity import (
    DEFAULT_PROFILE,
    FidelityConfig,
    LiveRun,
    run_fidelity,
)
from fineslab.workload import SHAREGPT_STATS

REPO = Path(__file__).resolve().parents[2]
IN_PROCESS_PROFILE = REPO / "profiles" / "llama-tiny--bf16--cpu.json"


def _config(tmp_path: Path, **kw: object) -> FidelityConfig:
    return FidelityConfig(tmp_path, REPO / DEFAULT_PROFILE, SHAREGPT_STATS,
                          Path(FineslabEnv.from_environ().model_cache_dir),
                          duration_s=20.0, **kw)  # type: ignore[arg-type]


def _live_is_the_simulator(monkeypatch: pytest.MonkeyPatch, calibrated: bool,
                           ttft_scales: tuple[float, ...] = (1.0,)) -> None:
    """The live side: the simulator's own summary, once per scale of its TTFT p50."""
    def measure_live(cfg: FidelityConfig, profile: object, requests: list) -> LiveRun:
        summary = fidelity.simulate_same(cfg, profile, requests, SimConfig())  # type: ignore
        other = load_profile(IN_PROCESS_PROFILE) if calibrated else None
        assert summary.ttft_s.p50 is not None
        runs = tuple(replace(summary, ttft_s=replace(summary.ttft_s, p50=summary.ttft_s.p50 * k))
                     for k in ttft_scales)
        return LiveRun(runs, other, (1.0, 1.5))

    monkeypatch.setattr(fidelity, "measure_live", measure_live)


def test_without_calibration_the_stored_profile_is_the_headline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _live_is_the_simulator(monkeypatch, calibrated=False)
    acceptance, text = run_fidelity(_config(tmp_path), SimConfig())
    assert acceptance["ttft_p50_error_stored_profile"] == 0.0, "live == simulated here"
    assert acceptance["ttft_p50_error"] == acceptance["ttft_p50_error_stored_profile"]
    assert acceptance["calibrated"] == 0.0 and "calibrated profile" not in text
    report = (tmp_path / "fidelity.md").read_text()
    assert "Target: `ttft_p50_error_stored_profile` < 0.25" in report
    assert "the full stack started for the run" in report and "1.0 / 1.5" in report
    assert "load average then: " in report and "not recorded" not in report, (
        "the committed HTTP profile records the load it was measured under")


def test_the_live_side_is_the_median_of_its_runs_with_their_spread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three live runs at 0.5x, 1x and 2x the simulated TTFT p50: the live figure is their
    median (so error 0), min and max are reported, and nothing needs explaining."""
    _live_is_the_simulator(monkeypatch, calibrated=False, ttft_scales=(0.5, 1.0, 2.0))
    acceptance, text = run_fidelity(_config(tmp_path), SimConfig())
    sim = acceptance["ttft_p50_sim"]
    assert acceptance["ttft_p50_live"] == sim and acceptance["ttft_p50_error"] == 0.0
    assert acceptance["ttft_p50_live_min"] == pytest.approx(sim / 2, abs=1e-4)
    assert acceptance["ttft_p50_live_max"] == pytest.approx(sim * 2, abs=1e-4)
    assert acceptance["live_runs"] == 3.0 and "Errors above" not in text


@pytest.mark.parametrize("scales, where", [((1.5, 1.6, 1.7), "outside the live runs' range"),
                                           ((0.9, 1.5, 1.6), "within the live runs' own range")])
def test_an_error_above_the_target_is_explained_against_the_live_spread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scales: tuple[float, ...],
        where: str) -> None:
    """Live runs all 1.5-1.7x the simulated TTFT p50: error 0.33, the simulated value outside
    what the live side did (the model's); runs at 0.9-1.6x: the same error, but one live run
    came within 10% of it, so the live side's own spread explains it."""
    _live_is_the_simulator(monkeypatch, calibrated=False, ttft_scales=scales)
    acceptance, text = run_fidelity(_config(tmp_path), SimConfig())
    assert acceptance["ttft_p50_error"] > 0.25
    explained = [line for line in text.splitlines() if line.startswith("- `ttft_p50`")]
    assert len(explained) == 1 and where in explained[0], text
    assert "Over 3 live run(s)" in explained[0] and "load average 1.0 before" in explained[0]
    assert not any(line.startswith("- `tpot_p50`") for line in text.splitlines()), "error 0"


def test_with_calibration_both_profiles_are_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _live_is_the_simulator(monkeypatch, calibrated=True)
    acceptance, text = run_fidelity(_config(tmp_path, calibrate=True), SimConfig())
    assert acceptance["ttft_p50_error_stored_profile"] == 0.0
    assert acceptance["ttft_p50_error"] > 0.25, (
        "unsuffixed keys are the calibrated (here: in-process, too fast) profile's")
    assert acceptance["calibrated"] == 1.0
    assert "Simulated with the stored profile" in text and "calibrated profile" in text
    assert (tmp_path / "calibrated" / "llama-tiny--bf16--cpu.json").is_file()


def test_the_committed_http_profile_says_how_it_was_measured() -> None:
    profile = load_profile(REPO / DEFAULT_PROFILE)
    assert profile.name == "llama-tiny--bf16--cpu", "device stays the kind the placer knows"
    assert profile.provenance["measured_via"].startswith("http: python -m fineslab.launch")
    assert "--via http" in profile.provenance["command"]
    assert "before" in profile.provenance["load_average"]
    assert profile.prefill_s(16) > load_profile(IN_PROCESS_PROFILE).prefill_s(16), (
        "through HTTP a prefill costs more than the engine step alone")


def test_the_fleet_config_is_valid_and_sized_like_the_simulated_pool(tmp_path: Path) -> None:
    cache = Path(FineslabEnv.from_environ().model_cache_dir)
    model_dir = ensure_model("llama-tiny", cache)
    spec = fleet_spec(MeasureConfig("llama-tiny", cache, tmp_path,
                                    max_total_tokens=fidelity.KV_POOL_TOKENS), model_dir)
    config = fleet_from_dict(spec.config("t"))
    (device,) = config.devices or ()
    assert device.kv_arena_bytes == fidelity.KV_POOL_TOKENS * 2048, "64 MiB of bf16 KV"
    assert config.kv_pool == "arena" and config.batch_policy == "fcfs"
    assert "--disable-radix-cache" in config.models[0].extra_args


@pytest.mark.slow
def test_http_profile_and_a_short_fidelity_run_on_one_fleet(tmp_path: Path) -> None:
    from fineslab.profile.one_model import serve_one_model

    cache = Path(FineslabEnv.from_environ().model_cache_dir)
    measure = MeasureConfig("llama-tiny", cache, tmp_path, quick=True, repeats=2,
                            max_total_tokens=fidelity.KV_POOL_TOKENS)
    spec = fleet_spec(measure, ensure_model("llama-tiny", cache))
    with serve_one_model(spec) as url:
        path = run_measure_http(measure, url=url)
        assert path.name == "llama-tiny--bf16--cpu-http.json"
        profile = load_profile(path)
        assert profile.decode.batch_sizes == (1, 4) and len(profile.prefill_s.xs) == 2
        assert f"--url {url}" in profile.provenance["command"]
        cfg = FidelityConfig(tmp_path / "report", path, SHAREGPT_STATS, cache, url=url,
                             duration_s=12.0, rate_per_s=0.5, repeats=1)
        acceptance, _ = run_fidelity(cfg, SimConfig())
    assert acceptance["num_completed_live"] >= 1
    assert math.isfinite(acceptance["ttft_p50_error_stored_profile"])
    json.dumps(acceptance)
    fleet_id = f"measure-{os.getpid()}"
    assert not fleet_processes(fleet_id) and not leftover_files(fleet_id, []), (
        "a clean exit stops the fleet and removes its arena files")

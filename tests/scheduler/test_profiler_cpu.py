"""A profile measured with SGLang on CPU loads and drives the placer and the local scheduler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fineslab.scheduler.local import BatchLimits, QueueSnapshot, WaitingRequest, get_batch_policy
from fineslab.scheduler.placement import GpuSpec, ModelDemand, get_placement_policy
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import ModelProfile, load_profile

COMMITTED = Path(__file__).resolve().parents[2] / "profiles" / "llama-tiny--bf16--cpu.json"
GIB = 1 << 30


def drive(profile: ModelProfile) -> None:
    """Place two replicas' worth of load on two CPU 'GPUs' and batch a queue with it."""
    assert profile.source == "measured"
    # llama-tiny bf16 KV: 4 layers x 2 x 2 kv heads x 64 dims x 2 bytes = 2048 bytes/token.
    assert profile.kv_token_bytes == 2048
    slo_s = 20 * profile.prefill_s(profile.workload.prompt_tokens)
    demand = ModelDemand("tiny", profile, request_rate_per_s=0.1, ttft_slo_s=slo_s)
    gpus = [GpuSpec(i, GIB, "cpu") for i in range(2)]
    for policy in ("mme", "mme-exact", "kvpr", "static"):
        plan = get_placement_policy(policy).place([demand], gpus)
        assert plan.unplaced == (), f"{policy}: {plan.unplaced}"
        assert plan.replicas[0].fixed_bytes >= profile.weights_bytes
    predictor = ChunkedPrefillPredictor.from_profile(profile)
    queue = tuple(WaitingRequest(f"r{i}", 0.0, 64) for i in range(8))
    decision = get_batch_policy("adaptive").decide(
        QueueSnapshot(queue, now_s=0.0, ttft_slo_s=slo_s, limits=BatchLimits(8, 4096)),
        predictor)
    assert decision.admitted, "a fresh queue with a 20x SLO must admit something"
    assert decision.predicted_finish_s is not None and decision.predicted_finish_s < slo_s


def test_committed_cpu_profile_drives_placer_and_batcher() -> None:
    drive(load_profile(COMMITTED))


@pytest.mark.slow
def test_profiler_writes_a_usable_profile_on_cpu(model_cache: Path, tmp_path: Path) -> None:
    # A subprocess: SGLang's engine spawns processes and must not share this test's state.
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.profile", "measure", "--model", "llama-tiny",
         "--quick", "--cache-dir", str(model_cache), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    drive(load_profile(tmp_path / "llama-tiny--bf16--cpu.json"))

"""The allocator benchmark runs end to end on a short op list and reports every key."""

from __future__ import annotations

import json

import pytest

from fineslab.bench import alloc


def test_alloc_bench_reports_private_and_pooled_costs(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    alloc.main(["--steps", "3000", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("slab_ns_per_page", "sglang_ns_per_page", "ratio", "slab_pooled_ns_per_page",
                "pooled_ratio", "pooled_ratio_cpu", "slab_raw_ns_per_page",
                "sglang_wall_ns_per_page", "slab_wall_ns_per_page",
                "slab_pooled_wall_ns_per_page", "ratio_wall"):
        assert result[key] > 0, f"{key} is measured"
    assert result["ratio"] == pytest.approx(
        result["slab_ns_per_page"] / result["sglang_ns_per_page"], abs=2e-3)
    assert result["pooled_ratio_cpu"] == pytest.approx(
        result["slab_pooled_ns_per_page"] / result["sglang_ns_per_page"], abs=2e-3)
    assert result["pooled_ratio"] == pytest.approx(  # wall time: lock waits count
        result["slab_pooled_wall_ns_per_page"] / result["sglang_wall_ns_per_page"], abs=2e-3)
    assert result["ratio_wall"] == pytest.approx(
        result["slab_wall_ns_per_page"] / result["sglang_wall_ns_per_page"], abs=2e-3)
    assert 0 < result["pooled_locked_share"] < 0.5, (
        "the key pool's block cache serves most calls without the table lock")
    for key in ("ratio", "pooled_ratio", "pooled_ratio_cpu", "ratio_wall"):
        figure = result[f"{key}_spread"]
        assert figure["n"] == 1 and figure["min"] == figure["median"] == figure["max"] == \
            result[key], (key, figure)


@pytest.mark.gpu
def test_alloc_bench_runs_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """`--device cuda`, as scripts/gpu_check.sh runs it: SGLang's free pages and the adapter's
    token indices on the GPU, the freed ids back on the host."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    alloc.main(["--device", "cuda", "--steps", "3000", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["device"] == "cuda"
    for key in ("slab_ns_per_page", "sglang_ns_per_page", "slab_pooled_ns_per_page"):
        assert result[key] > 0, f"{key} is measured on the GPU"

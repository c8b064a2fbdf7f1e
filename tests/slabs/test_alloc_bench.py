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
                "pooled_ratio", "slab_raw_ns_per_page"):
        assert result[key] > 0, f"{key} is measured"
    assert result["ratio"] == pytest.approx(
        result["slab_ns_per_page"] / result["sglang_ns_per_page"], abs=2e-3)
    assert result["pooled_ratio"] == pytest.approx(
        result["slab_pooled_ns_per_page"] / result["sglang_ns_per_page"], abs=2e-3)

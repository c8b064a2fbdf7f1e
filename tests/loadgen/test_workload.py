"""fineslab.workload: trace readers, arrival processes and the mix -> requests builder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fineslab.errors import ConfigError
from fineslab.workload import (
    AZURE_CONV,
    SHAREGPT_STATS,
    ModelLoad,
    WorkloadSpec,
    build_workload,
    load_arrival_trace,
    load_lengths,
    parse_mix,
    poisson_arrivals,
    replay_arrivals,
    time_scale_for_rate,
)

SHAREGPT, AZURE = SHAREGPT_STATS, AZURE_CONV


@pytest.fixture
def small_azure(tmp_path: Path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    "10.0,100,5\n12.0,0,7\n11.0,50,3\n14.0,9000,4000\n")
    return path


def test_lengths_are_clipped_and_empty_rows_skipped(small_azure: Path) -> None:
    table = load_lengths(small_azure, max_prompt_tokens=4096, max_output_tokens=1024)
    assert len(table) == 3, "the row with a 0-token prompt must be skipped"
    assert table.prompt_tokens.max() == 4096 and table.output_tokens.max() == 1024


def test_arrival_trace_is_sorted_and_rebased(small_azure: Path) -> None:
    trace = load_arrival_trace(small_azure)
    assert trace.arrival_s.tolist() == [0.0, 1.0, 4.0], "sorted, first arrival at 0"
    assert trace.lengths.prompt_tokens.tolist() == [100, 50, 8192], "lengths follow the sort"


def test_missing_column_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="num_prefill_tokens"):
        load_lengths(path)


def test_poisson_rate_and_window() -> None:
    times = poisson_arrivals(20.0, 500.0, np.random.default_rng(1))
    assert times.min() >= 0 and times.max() < 500.0
    assert np.all(np.diff(times) >= 0), "arrivals are sorted"
    assert abs(times.size / 500.0 - 20.0) < 1.0, "empirical rate within 5% of 20/s"
    gaps = np.diff(times)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05, "exponential gaps have CV 1"


def test_replay_compresses_time() -> None:
    trace = load_arrival_trace(AZURE)
    scale = time_scale_for_rate(trace, 55.0)
    times, rows = replay_arrivals(trace, scale, 60.0)
    assert abs(times.size / 60.0 - 55.0) / 55.0 < 0.35, "about the target rate in one minute"
    assert np.array_equal(times, trace.arrival_s[rows] / scale)


def test_workload_is_deterministic_per_seed() -> None:
    spec = WorkloadSpec((ModelLoad("a", 2.0), ModelLoad("b", 1.0)), 30.0, SHAREGPT, seed=7)
    first, again = build_workload(spec), build_workload(spec)
    other = build_workload(WorkloadSpec(spec.models, 30.0, SHAREGPT, seed=8))
    assert first == again, "the same seed gives the same requests"
    assert first != other, "another seed gives other requests"
    assert len({r.request_id for r in first}) == len(first), "ids are unique"
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)


def test_poisson_mix_follows_rates_and_scale() -> None:
    spec = WorkloadSpec((ModelLoad("a", 1.0), ModelLoad("b", 0.25)), 400.0, SHAREGPT,
                        rate_scale=4.0, seed=3)
    requests = build_workload(spec)
    count_a = sum(r.model == "a" for r in requests)
    count_b = sum(r.model == "b" for r in requests)
    assert abs(count_a / 400.0 - 4.0) < 0.4 and abs(count_b / 400.0 - 1.0) < 0.2
    assert all(1 <= r.prompt_tokens <= 8192 and r.output_tokens >= 1 for r in requests)


def test_replay_mix_splits_the_trace_by_weight() -> None:
    spec = WorkloadSpec((ModelLoad("a", 3.0), ModelLoad("b", 1.0)), 120.0, AZURE,
                        arrival="replay", seed=0)
    requests = build_workload(spec)
    share_a = sum(r.model == "a" for r in requests) / len(requests)
    assert 0.68 < share_a < 0.82, "model a gets about 3/4 of the trace"


def test_parse_mix() -> None:
    assert parse_mix("x:1.5, y") == (ModelLoad("x", 1.5), ModelLoad("y", 1.0))
    with pytest.raises(ConfigError):
        parse_mix("x:abc")

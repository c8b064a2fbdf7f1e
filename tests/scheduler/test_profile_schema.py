"""Profiles: the KV token formula, the JSON round trip, validation, and the TTFT predictor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fineslab.scheduler.curves import PiecewiseLinear, upper_concave_hull
from fineslab.scheduler.kv_format import kv_token_bytes
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import (
    DecodeTable,
    load_profile,
    load_profiles,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from fineslab.scheduler.roofline import PAPER_VARIANTS, analytical_profile
from hypothesis import given, settings
from hypothesis import strategies as st

from fineslab.errors import ConfigError

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


def test_kv_token_bytes_matches_block_format_by_hand() -> None:
    # Llama-3.1-8B FP16: 32 layers x 2 (K,V) x 8 heads x 128 dims x 2 bytes = 131072.
    assert kv_token_bytes(32, 8, 128, "fp16") == 131072
    # FP8 KV halves it: 65536.
    assert kv_token_bytes(32, 8, 128, "fp8") == 65536
    # INT4 KV: 32 x 2 x 8 x (128 x 0.5 + 4 bytes of FP16 scale and zero) = 32 x 2 x 8 x 68.
    assert kv_token_bytes(32, 8, 128, "int4") == 34816
    # Llama-3.1-70B FP8 at TP 2: 80 x 2 x (8 / 2) x 128 x 1 = 81920 per rank.
    assert kv_token_bytes(80, 8, 128, "fp8", tp=2) == 81920
    # llama-tiny FP32 KV: 4 x 2 x 2 x 64 x 4 = 4096.
    assert kv_token_bytes(4, 2, 64, "fp32") == 4096


def test_unknown_kv_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        kv_token_bytes(4, 2, 64, "int3")


def test_curve_interpolates_and_extends_linearly() -> None:
    curve = PiecewiseLinear.from_points([[0, 0.0], [10, 1.0], [20, 3.0]])
    assert curve(5) == pytest.approx(0.5)  # halfway along the first segment
    assert curve(30) == pytest.approx(5.0)  # last slope 0.2/token extended 10 tokens: 3 + 2
    with pytest.raises(ConfigError, match="strictly increasing"):
        PiecewiseLinear.from_points([[0, 0.0], [0, 1.0]])


def test_concave_hull_drops_a_dip() -> None:
    # (1, 0.5) lies below the chord (0,0)-(2,2): the hull skips it.
    assert upper_concave_hull([0, 1, 2, 3], [0, 0.5, 2, 2.5]) == [(0, 0), (2, 2), (3, 2.5)]


def test_chunked_prefill_ttft_by_hand() -> None:
    # prefill_s(n) = 0.01 + 0.001 n on [0, 1000]; chunk 100 tokens.
    predictor = ChunkedPrefillPredictor(
        PiecewiseLinear.from_points([[0, 0.01], [1000, 1.01]]), chunk_tokens=100)
    # 250 tokens = 2 full chunks (2 x 0.11) + 50 tokens (0.06) = 0.28 s.
    assert predictor.ttft_s([100, 150]) == pytest.approx(0.28)
    # One request of 50 tokens is a single partial chunk: 0.06 s.
    assert predictor.ttft_s([50]) == pytest.approx(0.06)
    assert predictor.ttft_s([]) == 0.0


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    profile = analytical_profile("llama-3.1-8b", "fp8", "h100")
    path = save_profile(profile, tmp_path)
    assert path.name == "llama-3.1-8b--fp8--h100.json"
    assert load_profile(path) == profile


def test_malformed_profile_names_the_file(tmp_path: Path) -> None:
    data = profile_to_dict(analytical_profile("llama-3.1-8b", "fp16", "h100"))
    data["prefill_s"] = [[16, 0.5], [64, 0.1]]  # latency falling with tokens: invalid
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"bad\.json.*must not decrease"):
        load_profile(bad)
    del data["decode"]
    with pytest.raises(ConfigError, match="malformed"):
        profile_from_dict(data, "x")


def test_committed_analytical_profiles_match_the_generator() -> None:
    profiles = load_profiles(PROFILES_DIR)
    for (model, precision) in PAPER_VARIANTS:
        for device in ("h100", "h200", "a100"):
            name = f"{model}--{precision}--{device}"
            assert profiles[name] == analytical_profile(model, precision, device), (
                f"{name} is stale: rerun python -m fineslab.profile analytical")


def test_lower_kv_precision_has_higher_mme() -> None:
    # Same model, same device: FP8 KV stores twice the tokens per byte, so its MME slope at
    # the start of the curve is higher (the paper's Figure 3).
    fp16 = analytical_profile("llama-3.1-8b", "fp16", "h100").mme
    fp8 = analytical_profile("llama-3.1-8b", "fp8", "h100").mme
    assert fp8.ys[1] / fp8.xs[1] > fp16.ys[1] / fp16.xs[1]


def uncached_step_s(table: DecodeTable, batch_size: float, context_tokens: float) -> float:
    """The reading `DecodeTable.step_s` used to do on every call: every row, then the column."""
    contexts = tuple(float(c) for c in table.context_tokens)
    by_batch = [PiecewiseLinear(contexts, tuple(row))(context_tokens) for row in table.seconds]
    return PiecewiseLinear(tuple(float(b) for b in table.batch_sizes), tuple(by_batch))(batch_size)


def test_cached_decode_reading_equals_the_uncached_one_on_every_profile() -> None:
    # Issue 7: step_s caches its row curves; the answers must not move by a single bit,
    # inside the table and extrapolated beyond both axes.
    for profile in load_profiles(PROFILES_DIR).values():
        table = profile.decode
        for batch in (0.5, 1, 3, 7.5, 64, 200, 256, 1000):
            for context in (0, 100, 1234.5, 4096, 20000, 200000):
                assert table.step_s(batch, context) == uncached_step_s(table, batch, context), \
                    f"{profile.name}: cached reading differs at batch {batch}, context {context}"


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_cached_decode_reading_equals_the_uncached_one_on_random_tables(
        num_batches: int, num_contexts: int, data: st.DataObject) -> None:
    batches = sorted(data.draw(st.sets(st.integers(1, 512), min_size=num_batches,
                                       max_size=num_batches)))
    contexts = sorted(data.draw(st.sets(st.integers(1, 32768), min_size=num_contexts,
                                        max_size=num_contexts)))
    seconds = tuple(tuple(data.draw(st.floats(0.0, 1.0)) for _ in contexts) for _ in batches)
    table = DecodeTable(tuple(batches), tuple(contexts), seconds)
    batch = data.draw(st.floats(0.0, 1024.0))
    context = data.draw(st.floats(0.0, 65536.0))
    assert table.step_s(batch, context) == uncached_step_s(table, batch, context)


def test_decode_table_equality_ignores_its_cache() -> None:
    table = DecodeTable((1, 8), (128, 1024), ((0.01, 0.02), (0.03, 0.05)))
    assert table == DecodeTable((1, 8), (128, 1024), ((0.01, 0.02), (0.03, 0.05)))
    with pytest.raises(ConfigError):
        DecodeTable((8, 1), (128, 1024), ((0.01, 0.02), (0.03, 0.05)))

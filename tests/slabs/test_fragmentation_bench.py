"""The fragmentation benchmark's modelling rules, each on a case small enough to check by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fineslab.bench import fragmentation as frag
from fineslab.bench.fragmentation_replay import (
    Workload,
    block_events,
    critical_arena,
    matched_rate_per_s,
    replay,
)
from fineslab.bench.fragmentation_schemes import (
    CountingScheme,
    FirstFitScheme,
    FixedBlockPlan,
    SchemeSet,
    SlabScheme,
    fixed_block_plans,
    fixed_block_tokens,
)
from fineslab.errors import ConfigError
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape

# token bytes = layers x 2 x heads x head_dim x 2 (BF16)
BIG = KVShape("big", 1, 1, 40, KVDtype.BF16)  # 160 B a token
SMALL = KVShape("small", 1, 1, 24, KVDtype.BF16)  # 96 B a token


def test_fixed_block_pads_a_token_that_does_not_divide_the_block() -> None:
    # A 320 B block holds 2 BIG tokens (stride 160). SMALL's 96 B token does not divide 320, and
    # flat indexing needs block = page x stride with a 16-aligned stride >= 96: strides 112, 128,
    # 144 do not divide 320, 160 does -> page 2, remainder 320 - 2 x 96 = 128 B (not floor(320 /
    # 96) = 3 tokens with 32 B left, which SGLang's one-stride view could not address).
    assert fixed_block_tokens(BIG, 320, min_page=1) == 2
    assert fixed_block_tokens(SMALL, 320, min_page=1) == 2
    plan = FixedBlockPlan.fit((BIG, SMALL), 320, min_page=1)
    assert plan is not None and plan.tokens_per_block == (2, 2)
    assert plan.remainder_waste == pytest.approx((0.0, 128 / 320)), "waste = B - page x token"


def test_fixed_block_respects_the_minimum_page_and_alignment() -> None:
    # 640 B: SMALL's smallest fitting stride is 128 B (5 tokens, 160 B lost); with min_page 8 no
    # stride >= 96 leaves 8 tokens, so the block does not fit SMALL at all.
    assert fixed_block_tokens(SMALL, 640, min_page=1) == 5
    assert fixed_block_tokens(SMALL, 640, min_page=8) is None
    assert fixed_block_tokens(SMALL, 328, min_page=1) is None, "328 is not 16-byte aligned"


def test_fixed_block_plans_for_the_benchmark_models() -> None:
    plans = fixed_block_plans(frag.MODELS, min_page=16, max_waste=0.02)
    largest, lowpad = plans["largest"], plans["lowpad"]
    assert largest.block_bytes == 16 * 163840, "the 70B shard's 16-token block"
    assert largest.tokens_per_block == (20, 40, 160, 16)
    assert largest.remainder_waste[2] == pytest.approx(1 - 160 * 15232 / 2621440)
    assert max(lowpad.remainder_waste) <= 0.02 and lowpad.block_bytes > largest.block_bytes


def test_first_fit_aligned_skips_to_a_multiple_of_the_block_size() -> None:
    # arena 12 B, block sizes 3 and 2: model 0 takes [0, 3); model 1's block must start at 4,
    # leaving the hole [3, 4); unaligned, it would start at 3.
    aligned = FirstFitScheme(12, [3, 2], aligned=True)
    assert aligned.alloc(0, 1) == [(0, 3)]
    assert aligned.alloc(1, 1) == [(4, 2)]
    assert aligned.starts.tolist() == [3, 6] and aligned.sizes.tolist() == [1, 6]
    unaligned = FirstFitScheme(12, [3, 2], aligned=False)
    unaligned.alloc(0, 1)
    assert unaligned.alloc(1, 1) == [(3, 2)]


def test_first_fit_free_coalesces_holes() -> None:
    scheme = FirstFitScheme(12, [3, 2], aligned=True)
    a = scheme.alloc(0, 1)
    b = scheme.alloc(1, 2)
    assert b == [(4, 4)], "two 2 B blocks, contiguous"
    scheme.free(0, [a])
    scheme.free(1, [b])
    assert scheme.starts.tolist() == [0] and scheme.sizes.tolist() == [12]


def _tiny_workload(rows: list[tuple[float, int, int]]) -> Workload:
    arrival, prefill, decode = (np.array(c) for c in zip(*rows, strict=True))
    return Workload.of(arrival, prefill, decode, tpot_s=1.0, shapes=(SMALL,))


def test_refusal_with_room_left_is_a_fragmentation_failure() -> None:
    # 4-token blocks of 96 B tokens; the pool holds 2 blocks, the arena 1,000 B. A's 5-token
    # prompt takes both blocks (480 B live); B's 1-token prompt is refused although 480 + 96
    # <= 1,000: a fragmentation refusal at utilization 0.48.
    work = _tiny_workload([(0.0, 5, 3), (0.5, 1, 1)])
    tpb = np.array([4])
    out = replay(work, block_events(work, tpb), CountingScheme([2], [0]), 1000)
    assert out.first_failure_util == pytest.approx(0.48)
    assert out.first_failure_s == 0.5
    assert out.num_capacity_refusals == 0 and out.num_dropped == 1


def test_refusal_of_more_than_the_arena_holds_is_a_capacity_refusal() -> None:
    # C's 11-token prompt (1,056 B) cannot fit a 1,000 B arena whatever the allocator.
    work = _tiny_workload([(0.0, 11, 1)])
    out = replay(work, block_events(work, np.array([4])), CountingScheme([2], [0]), 1000)
    assert out.first_failure_util is None, "a capacity refusal is not a fragmentation failure"
    assert out.first_refusal_util == 0.0 and out.num_capacity_refusals == 1


def test_block_events_open_a_block_when_the_last_one_fills() -> None:
    # prompt 3, 6 decode tokens, 4-token blocks: prompt 1 block; the tokens at index 4 and 8
    # (decode steps 2 and 6) open blocks 2 and 3; free at 6 s.
    work = _tiny_workload([(0.0, 3, 6)])
    times, kinds, _, counts = block_events(work, np.array([4]))
    assert times.tolist() == [0.0, 2.0, 6.0, 6.0]
    assert kinds.tolist() == [0, 0, 0, 1] and counts.tolist() == [1, 1, 1, 0]


def test_mean_demand_is_the_exact_integral_of_live_bytes() -> None:
    work = _tiny_workload([(0.0, 3, 6), (2.0, 5, 2)])
    grid = np.linspace(0, float(work.end_s.max()), 200_001)[:-1]
    alive = np.ones(2, dtype=bool)
    sampled = np.mean([work.live_bytes(float(t), alive) for t in grid])
    assert work.mean_demand_bytes()[0] == pytest.approx(sampled, rel=1e-3)


def test_matched_rate_reproduces_the_target_demand() -> None:
    prompt, output = np.array([100, 300]), np.array([10, 30])
    rate = matched_rate_per_s(1e9, prompt, output, np.array([1000, 3000]), 0.05)
    per_request = 0.05 * np.mean([10 * 100 + 45, 30 * 300 + 435]) * 2000
    assert rate * per_request == pytest.approx(1e9)


@pytest.mark.slow
def test_benchmark_runs_end_to_end_on_a_small_trace(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    trace = tmp_path / "trace.csv"
    rows = np.column_stack([np.sort(rng.uniform(0, 60, 200)), rng.integers(50, 3000, 200),
                            rng.integers(5, 200, 200)])
    np.savetxt(trace, rows, delimiter=",", header="arrived_at,num_prefill_tokens,"
               "num_decode_tokens", comments="", fmt=["%.3f", "%d", "%d"])
    frag.main([str(trace), "--arena-gib", "1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    peak = result["peak_live_bytes"]
    for key in ("slab", "slab_private", "static", "fixed_block", "first_fit"):
        assert key in result, f"the issue's key {key}"
        assert 0 < result[key] <= 1, "utilization at the first failure is a fraction"
        arena, failing = result[f"{key}_arena_bytes"], result[f"{key}_failing_arena_bytes"]
        assert failing < arena and arena - failing <= max(1, 2e-4 * peak) + 1, \
            "the critical arena is bracketed to the tolerance"
        assert failing >= peak - 1, "no scheme serves the trace in less than its peak"
        assert result[f"{key}_peak_share"] == pytest.approx(peak / arena, abs=1e-4)
        fixed = result["fixed_arena"]
        assert f"{key}_time_avg" in fixed and f"{key}_dropped" in fixed, "the fixed protocol"
    assert result["fixed_block_variant"] in ("fixed_block_largest", "fixed_block_lowpad")
    assert result["first_fit_variant"] in ("first_fit_plan_pages", "first_fit_min_page")
    assert "first_fit_unaligned" not in result, "not servable: fixed protocol only"
    assert "first_fit_unaligned" in result["fixed_arena"]


def test_peak_live_is_the_highest_live_bytes_of_the_sweep() -> None:
    # A: prompt 3, 6 decode tokens from 0 s (3 + floor(t) tokens); B: prompt 5, 2 tokens from
    # 2 s to 4 s. In [3, 4): A 6 + B 6 = 12 tokens of 96 B, more than at any other time.
    work = _tiny_workload([(0.0, 3, 6), (2.0, 5, 2)])
    assert work.peak_live() == (12 * 96, 3.0)
    grid = np.linspace(0, 6, 6001)
    alive = np.ones(2, dtype=bool)
    assert max(work.live_bytes(float(t), alive) for t in grid) == 12 * 96


def test_replay_stops_at_its_first_refusal_when_asked() -> None:
    # A pool of one block: A's 4-token prompt fills it; B (0.5 s) is refused, then A's first
    # decode token needs a second block (1 s) and A is dropped; C (1.5 s) gets the freed block.
    work = _tiny_workload([(0.0, 4, 4), (0.5, 1, 1), (1.5, 1, 1)])
    events = block_events(work, np.array([4]))
    full = replay(work, events, CountingScheme([1], [0]), 10_000)
    stopped = replay(work, events, CountingScheme([1], [0]), 10_000, stop_at_first_refusal=True)
    assert full.num_dropped == 2 and len(full.failure_utils) == 2, "B, then A's decode block"
    assert stopped.num_dropped == 1 and stopped.time_avg_util is None
    assert stopped.first_failure_s == full.first_failure_s


def test_critical_arena_of_a_counting_pool_is_its_peak_blocks() -> None:
    # 4-token blocks of 96 B = 384 B. A (prompt 5 -> 2 blocks, 3 decode tokens, no new block)
    # from 0 s to 3 s; B (1 block) from 0.5 s to 1.5 s: at most 3 blocks at once, so the pool
    # serves the trace from 3 x 384 = 1,152 B and refuses B in 1,151 B, when only A's 5 tokens
    # (480 B) are live.
    work = _tiny_workload([(0.0, 5, 3), (0.5, 1, 1)])
    events = block_events(work, np.array([4]))
    peak_bytes, _ = work.peak_live()
    assert peak_bytes == 7 * 96, "A's 6 tokens and B's 1 in [1, 1.5)"
    crit = critical_arena(work, events, lambda arena: CountingScheme([arena // 384], [0]),
                          peak_bytes, tolerance=1e-3)
    assert (crit.arena_bytes, crit.failing_arena_bytes) == (1152, 1151)
    assert crit.first_failure.first_failure_s == 0.5
    assert crit.first_failure.first_failure_util == pytest.approx(480 / 1151)


def test_critical_arena_refuses_a_bad_tolerance() -> None:
    work = _tiny_workload([(0.0, 5, 3)])
    with pytest.raises(ConfigError, match="tolerance"):
        critical_arena(work, block_events(work, np.array([4])),
                       lambda arena: CountingScheme([arena // 384], [0]), 480, tolerance=0)


def test_scheme_set_builds_every_scheme_with_its_plans_pages(tmp_path: Path) -> None:
    schemes = SchemeSet.plan(frag.MODELS, tuple(range(16, 65)), np.ones(4), 2 * frag.GIB)
    shared_pages = [f.tokens_per_block for f in schemes.shared.formats]
    for name in schemes.names:
        scheme = schemes.build(name, frag.GIB, tmp_path)
        assert scheme.alloc(0, 1) is not None, f"{name} serves one block"
        scheme.close()
    assert schemes.tokens_per_block("slab").tolist() == shared_pages
    assert schemes.tokens_per_block("first_fit_plan_pages").tolist() == shared_pages
    assert schemes.tokens_per_block("first_fit_min_page").tolist() == [16] * 4
    assert schemes.tokens_per_block("fixed_block_largest").tolist() == [20, 40, 160, 16]
    assert not list(tmp_path.iterdir()), "a closed slab scheme leaves no table file"
    with pytest.raises(ConfigError, match="unknown scheme"):
        schemes.build("buddy", frag.GIB, tmp_path)


def test_key_pools_serve_a_request_private_slabs_would_strand(tmp_path: Path) -> None:
    # Two models with the same 512 B block, one 4-block slab: model 0 takes 3 blocks; model 1's
    # block fits in the pool's last free block, while with private slabs it needs a second slab.
    fmt = BlockFormat.unpadded(KVShape("x", 1, 1, 16, KVDtype.BF16), 8)  # 64 B x 8 = 512 B
    other = BlockFormat.unpadded(KVShape("y", 1, 1, 16, KVDtype.BF16), 8)
    pooled = SlabScheme(2048, 2048, [fmt, other], tmp_path, key_pools=True)
    private = SlabScheme(2048, 2048, [fmt, other], tmp_path, key_pools=False)
    for scheme in (pooled, private):
        assert scheme.alloc(0, 3) is not None
    assert pooled.alloc(1, 1) is not None, "the pool's free block serves model 1"
    assert private.alloc(1, 1) is None, "model 0's free block is stranded for model 1"
    pooled.close()
    private.close()


def test_an_unknown_scheme_name_is_a_clear_error(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,10\n")
    with pytest.raises(SystemExit, match=r"unknown scheme.*buddy"):
        frag.main([str(trace), "--schemes", "slab,buddy"])


def test_page_sizes_take_a_list_or_a_range() -> None:
    assert frag.parse_page_sizes("16,32,64") == (16, 32, 64)
    assert frag.parse_page_sizes("16-20") == (16, 17, 18, 19, 20)

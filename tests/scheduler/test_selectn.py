"""Select-N (scheduler/selectn.py): offloaded layers, the cost model, the record, the link.

The hand-worked model of these tests (unit-free: seconds and bytes are small integers so the
floats are exact): L = 8 layers, T_T = 4 (16-byte layers on a 4 bytes/s link). Step time at
interval i, t(i) = L*T_c + floor(L/i) * max(0, T_T - (i-1)*T_c), at T_c = 1:

    i      0   2   3   4   5..8
    k(i)   0   4   2   2   1
    t(i)   8  20  12  10   8

Decode T_c(batch, seq) = batch * seq / 256, prefill T_c = 4x that.
"""

from __future__ import annotations

import itertools
import random

import pytest
from fineslab.scheduler.selectn import (
    LayerCosts,
    LinkCoordinator,
    LinkRuntime,
    PerformanceRecord,
    footprint_bytes,
    offload_layers,
    paper_interval_estimate,
    smallest_interval,
    step_time_s,
)

from fineslab.errors import ConfigError

BATCHES = (1, 2, 4)
SEQS = (64, 128, 256)
DECODE = {(b, s): b * s / 256 for b in BATCHES for s in SEQS}


def _costs() -> LayerCosts:
    return LayerCosts.on_link(8, 16, 4.0, prefill=lambda b, s: 4 * b * s / 256, decode=DECODE)


def _record() -> PerformanceRecord:
    return PerformanceRecord.build(_costs(), ttft_slos_s=(10.0, 1000.0),
                                   tpot_slos_s=(10.0, 20.0), batch_sizes=BATCHES,
                                   seq_lens=SEQS)


# offload_layers


def test_offload_layers_takes_the_last_layer_of_every_full_interval() -> None:
    assert offload_layers(8, 4) == [3, 7]
    assert offload_layers(8, 2) == [1, 3, 5, 7]
    assert offload_layers(8, 8) == [7]
    assert offload_layers(10, 4) == [3, 7], "the trailing partial interval (8, 9) stays"


def test_offload_layers_offloads_nothing_at_zero_or_above_the_layer_count() -> None:
    assert offload_layers(8, 0) == []
    assert offload_layers(8, 9) == [], "no full interval of 9 in 8 layers"


def test_offload_layers_refuses_interval_one_negative_intervals_and_no_layers() -> None:
    with pytest.raises(ConfigError, match="every layer would stream"):
        offload_layers(8, 1)
    with pytest.raises(ConfigError, match="0 \\(none\\) or >= 2"):
        offload_layers(8, -2)
    with pytest.raises(ConfigError, match="num_layers"):
        offload_layers(0, 2)


# The cost model: equations (2) to (5)


def test_step_time_matches_the_hand_worked_table() -> None:
    expected = {0: 8.0, 2: 20.0, 3: 12.0, 4: 10.0, 5: 8.0, 8: 8.0}
    got = {i: step_time_s(8, i, 4.0, 1.0) for i in expected}
    assert got == expected
    # A trailing partial interval: L = 10, i = 4 offloads 2 layers, each stalling 4 - 3 = 1.
    assert step_time_s(10, 4, 4.0, 1.0) == 12.0


def test_ttft_and_tpot_use_their_own_phase_compute_time() -> None:
    costs = _costs()
    assert costs.tpot_s(3, 4, 64) == 12.0, "decode T_c(4, 64) = 1: t(3) = 12"
    assert costs.ttft_s(3, 1, 64) == 12.0, "prefill T_c(1, 64) = 4 * 0.25 = 1"
    assert costs.tpot_s(3, 1, 64) == 9.0, "decode T_c(1, 64) = 0.25: 2 + 2 * 3.5"


def test_smallest_interval_meets_the_slo_and_the_one_below_misses() -> None:
    for slo_s, expected in ((20.0, 2), (12.0, 3), (11.0, 4), (10.0, 4), (9.0, 5), (8.0, 5)):
        interval = smallest_interval(8, 4.0, 1.0, slo_s)
        assert interval == expected, f"SLO {slo_s}"
        assert step_time_s(8, interval, 4.0, 1.0) <= slo_s
        if interval > 2:
            assert step_time_s(8, interval - 1, 4.0, 1.0) > slo_s, "not the smallest"


def test_smallest_interval_is_zero_when_only_all_resident_meets_and_none_when_nothing() -> None:
    assert smallest_interval(8, 4.0, 0.25, 3.0) == 0, "t(0) = 2 <= 3 but t(8) = 4.25"
    assert smallest_interval(8, 4.0, 1.0, 7.9) is None, "t(0) = 8 > 7.9"


def test_both_phases_must_meet_with_one_interval() -> None:
    costs = _costs()
    # (1, 64): prefill T_c = 1 meets TTFT 10 from 4; decode T_c = 0.25 meets TPOT 20 from 2.
    assert costs.smallest_interval(1, 64, ttft_slo_s=10.0, tpot_slo_s=20.0) == 4
    assert costs.smallest_interval(1, 64, ttft_slo_s=1000.0, tpot_slo_s=20.0) == 2
    assert costs.smallest_interval(1, 64, ttft_slo_s=1000.0, tpot_slo_s=3.0) == 0, \
        "decode needs every layer resident: 0 outranks any interval"
    assert costs.smallest_interval(1, 64, ttft_slo_s=7.0, tpot_slo_s=20.0) is None


def test_the_papers_closed_form_offloads_more_than_its_own_budget() -> None:
    # delta = 0.5 over t(0) = 8 is the SLO 12 of the table: Select-N's optimum is 3.
    assert paper_interval_estimate(8, 4.0, 1.0, 0.5) == 2, "L_off = floor(12 / 4) = 3, 8 // 3"
    assert step_time_s(8, 2, 4.0, 1.0) > 12.0, "its interval misses the SLO it was given"
    assert smallest_interval(8, 4.0, 1.0, 12.0) == 3
    assert paper_interval_estimate(8, 4.0, 0.25, 0.5) == 0, "L_off = floor(0.75) = 0"


def test_a_relative_slo_gives_the_shape_of_the_papers_table_1() -> None:
    # SLO = 1.5 x the step without offloading, per (batch, seq): larger shapes compute longer
    # and hide more copy time, so the optimal interval falls along rows and columns.
    table = [[smallest_interval(8, 4.0, DECODE[(b, s)], 1.5 * 8 * DECODE[(b, s)])
              for s in SEQS] for b in BATCHES]
    assert table == [[0, 5, 3],
                     [5, 3, 2],
                     [3, 2, 2]]


# The performance record


def test_the_record_holds_the_hand_worked_table_at_each_slo() -> None:
    record = _record()
    assert record.table(1000.0, 10.0) == [[3, 3, 4],
                                          [3, 4, None],
                                          [4, None, None]], "absolute SLO: slower shapes need more"
    assert record.table(1000.0, 20.0) == [[2, 2, 2],
                                          [2, 2, 3],
                                          [2, 3, None]]


def test_lookup_rounds_batch_and_sequence_length_up() -> None:
    record = _record()
    assert record.lookup(1000.0, 10.0, 2, 65) == 4, "seq 65 answers from 128"
    assert record.interval_at((1000.0, 10.0, 2, 64)) == 3, "control: rounding down says 3"
    assert record.lookup(1000.0, 10.0, 3, 64) == 4, "batch 3 answers from 4"
    assert record.interval_at((1000.0, 10.0, 2, 64)) != record.lookup(1000.0, 10.0, 3, 64)


def test_lookup_rounds_slos_down() -> None:
    record = _record()
    assert record.lookup(1000.0, 15.0, 2, 128) == 4, "TPOT 15 answers from 10"
    assert record.interval_at((1000.0, 20.0, 2, 128)) == 2, "control: rounding up says 2"
    assert record.lookup(999.0, 20.0, 1, 64) == 4, "TTFT 999 answers from 10: prefill binds"
    assert record.interval_at((1000.0, 20.0, 1, 64)) == 2, "control: TTFT 1000 says 2"


def test_lookup_refuses_outside_the_grid_and_clamps_loose_slos() -> None:
    record = _record()
    assert record.grid_point(1000.0, 10.0, 8, 64) is None, "batch above the grid"
    assert record.lookup(1000.0, 10.0, 8, 64) is None
    assert record.lookup(1000.0, 10.0, 1, 512) is None, "sequence above the grid"
    assert record.lookup(1000.0, 5.0, 1, 64) is None, "TPOT tighter than the grid"
    assert record.grid_point(5000.0, 50.0, 1, 64) == (1000.0, 20.0, 1, 64)
    assert record.lookup(5000.0, 50.0, 1, 64) == 2, "a looser SLO answers from the largest"


def test_the_record_validates_its_grid() -> None:
    with pytest.raises(ConfigError, match="powers of two"):
        PerformanceRecord.build(_costs(), (10.0,), (10.0,), (3,), (64,))
    with pytest.raises(ConfigError, match="positive"):
        PerformanceRecord.build(_costs(), (0.0,), (10.0,), (1,), (64,))
    with pytest.raises(ConfigError, match="cover the grid"):
        PerformanceRecord((10.0,), (10.0,), (1,), (64,), {})
    with pytest.raises(ConfigError, match="no measured layer time"):
        PerformanceRecord.build(_costs(), (10.0,), (10.0,), (8,), (64,))


# footprint_bytes (F_M)


def test_footprint_keeps_one_minus_one_over_i_of_the_weights() -> None:
    assert footprint_bytes(1000, 4) == 750
    assert footprint_bytes(1000, 3) == 667, "rounded up"
    assert footprint_bytes(1000, 0) == 1000
    with pytest.raises(ConfigError, match="every layer would stream"):
        footprint_bytes(1000, 1)


def test_the_layer_exact_footprint_counts_the_partial_interval_and_the_staging_buffer() -> None:
    # L = 10, i = 4: 8 resident layers + 1 staging buffer; F_M would say 750.
    assert footprint_bytes(1000, 4, num_layers=10) == 900
    assert footprint_bytes(800, 4, num_layers=8) == 700, "6 resident + 1 staging"
    assert footprint_bytes(800, 9, num_layers=8) == 800, "nothing offloaded, no buffer"


# The link coordinator (figure 8, n runtimes)
#
# On a 4 bytes/s link, T_c = 1, L = 8; A: 16-byte layers (T_T = 4), B: 12-byte (T_T = 3);
# C: L = 4, 8-byte layers (T_T = 2), T_c = 4. Candidates (rate bytes/s, host bytes):
#
#   A, TPOT 20:  2 (3.2, 64)   3 (2.67, 32)   5 (2.0, 16)   0 (0, 0)
#   B, TPOT 16:  2 (3.0, 48)   3 (2.4, 24)    5 (1.5, 12)   0 (0, 0)
#   C, TPOT 16:  2 (1.0, 16)   3 (0.5, 8)     0 (0, 0)


def _a(max_interval: int | None = None) -> LinkRuntime:
    return LinkRuntime("a", 8, 16, 1.0, 20.0, max_interval)


B = LinkRuntime("b", 8, 12, 1.0, 16.0)
C = LinkRuntime("c", 4, 8, 4.0, 16.0)


def test_candidates_meet_the_slo_and_keep_one_interval_per_offloaded_count() -> None:
    link = LinkCoordinator(4.0)
    assert link.candidates(_a()) == (2, 3, 5, 0), "4 and 6..8 repeat k of 3 and 5"
    assert link.candidates(B) == (2, 3, 5, 0)
    assert link.candidates(C) == (2, 3, 0)
    assert link.candidates(_a(max_interval=4)) == (2, 3), "memory forbids 5 and 0"
    assert link.candidates(LinkRuntime("x", 8, 16, 1.0, 11.0)) == (4, 5, 0), "3 misses 11"
    assert link.stream_bytes_per_s(_a(), 2) == pytest.approx(3.2)
    assert link.stream_bytes_per_s(B, 3) == pytest.approx(2.4)


def test_two_runtimes_fill_host_memory_within_the_link() -> None:
    link = LinkCoordinator(4.0)
    assert link.stream_bytes_per_s(_a(), 2) + link.stream_bytes_per_s(B, 2) > 4.0, \
        "control: both at their minimum overflow the link"
    plan = link.plan([_a(), B])
    assert plan is not None and plan.intervals == {"a": 2, "b": 0}
    assert plan.host_bytes == 64 and plan.stream_bytes_per_s == pytest.approx(3.2)


def test_a_smaller_budget_moves_the_offload_to_the_cheaper_stream() -> None:
    plan = LinkCoordinator(4.0, headroom=0.75).plan([_a(), B])  # budget 3: A at 2 (3.2) fails
    assert plan is not None and plan.intervals == {"a": 0, "b": 2}
    assert plan.host_bytes == 48 and plan.stream_bytes_per_s == pytest.approx(3.0)


def test_three_runtimes_raise_one_above_its_minimum_to_fit_the_link() -> None:
    link = LinkCoordinator(4.0)
    plan = link.plan([_a(), B, C])
    # A 2 + C 3: 3.7 bytes/s, 64 + 8 = 72 bytes. Runner-up: B 2 + C 2 (4.0, 64).
    assert plan is not None and plan.intervals == {"a": 2, "b": 0, "c": 3}
    assert plan.host_bytes == 72 and plan.stream_bytes_per_s == pytest.approx(3.7)
    assert link.plan([B, C]) is not None and link.plan([B, C]).intervals == {"b": 2, "c": 2}, \
        "control: without A, C takes its minimum (3.0 + 1.0 = 4.0 fits)"


def test_the_coordinator_refuses_when_a_runtime_cannot_meet_its_slo() -> None:
    link = LinkCoordinator(4.0)
    assert link.plan([_a(), LinkRuntime("late", 8, 16, 1.0, 7.0)]) is None, "t(0) = 8 > 7"
    assert link.plan([_a(max_interval=4), B]) is not None
    assert LinkCoordinator(4.0, headroom=0.5).plan([_a(max_interval=4)]) is None, \
        "A must stream (memory) at >= 2.67 bytes/s, budget 2"


def test_the_coordinator_validates_its_input() -> None:
    with pytest.raises(ConfigError, match="unique"):
        LinkCoordinator(4.0).plan([B, B])
    with pytest.raises(ConfigError, match="exceed"):
        LinkCoordinator(4.0, max_combinations=10).plan([_a(), B])
    with pytest.raises(ConfigError, match="max_interval"):
        _a(max_interval=1)


def test_the_plan_equals_brute_force_over_every_interval_on_random_links() -> None:
    rng = random.Random(17)
    for _ in range(40):
        link = LinkCoordinator(rng.uniform(2.0, 8.0))
        runtimes = [LinkRuntime(f"r{n}", rng.choice((4, 6, 8)), rng.randint(4, 24),
                                rng.uniform(0.2, 3.0), rng.uniform(5.0, 60.0))
                    for n in range(3)]
        plan = link.plan(runtimes)
        every = [[i for i in (0, *range(2, r.num_layers + 1))
                  if step_time_s(r.num_layers, i, r.layer_bytes / link.link_bytes_per_s,
                                 r.layer_compute_s) <= r.tpot_slo_s] for r in runtimes]
        best = None
        for combo in itertools.product(*every):
            rate = sum(link.stream_bytes_per_s(r, i) for r, i in zip(runtimes, combo,
                                                                    strict=True))
            if rate <= link.link_bytes_per_s:
                host = sum(len(offload_layers(r.num_layers, i)) * r.layer_bytes
                           for r, i in zip(runtimes, combo, strict=True))
                best = host if best is None else max(best, host)
        assert (plan.host_bytes if plan else None) == best, "dedup lost the optimum"
        if plan is not None:
            assert plan.stream_bytes_per_s <= link.link_bytes_per_s * (1 + 1e-9)


def test_a_runtimes_min_interval_bounds_its_candidates_from_below() -> None:
    """`min_interval` (its TTFT's own choice): nothing below it is offered, 0 still is."""
    coordinator = LinkCoordinator(1e9)
    free = LinkRuntime("free", 8, 1_000_000, 1.0, 100.0)
    bounded = LinkRuntime("bounded", 8, 1_000_000, 1.0, 100.0, min_interval=3)
    assert coordinator.candidates(free)[0] == 2
    assert coordinator.candidates(bounded)[0] == 3 and coordinator.candidates(bounded)[-1] == 0
    with pytest.raises(ConfigError, match="min_interval"):
        LinkRuntime("bad", 8, 1, 1.0, 1.0, min_interval=1)

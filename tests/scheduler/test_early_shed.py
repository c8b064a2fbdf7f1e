"""The early-shed peer of Algorithm 2 on hand-checked queues (issue #15, defect 10).

Same queue and predictor as test_local_batching (TTFT = 1 ms per prompt token, now = 10.0 s,
SLO 1.0 s); `slot_free_in_s` is the router's forecast of when each slot frees.
"""

from __future__ import annotations

from fineslab.scheduler.local import BatchLimits, QueueSnapshot, get_batch_policy
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduler.test_local_batching import LINEAR_1MS, QUEUE, ids


def snap(max_requests: int, slots: tuple[float, ...], mean_s: float = 1.0) -> QueueSnapshot:
    return QueueSnapshot(QUEUE, 10.0, 1.0, BatchLimits(max_requests, 10_000), slots, mean_s)


def test_a_deferred_request_no_slot_reaches_in_time_is_dropped_now() -> None:
    # Two free slots, two busy ones freeing in 0.3 s and 0.6 s. Algorithm 2 admits b d (into
    # the free slots) and defers c e. c waits 0.3 s: 10 + 0.3 + 0.4 = 10.7 >= 10.6, dropped
    # now; e waits 0.6 s: 10.65 < 11.0, kept waiting.
    decision = get_batch_policy("adaptive-early-shed").decide(snap(2, (0, 0, 0.3, 0.6)),
                                                              LINEAR_1MS)
    assert ids(decision.admitted) == ["b", "d"]
    assert [d.request.request_id for d in decision.dropped] == ["a", "c"]
    assert ids(decision.deferred) == ["e"]
    reason = decision.dropped[1].reason
    assert "slots are taken" in reason and "1 s target" in reason, reason


def test_with_no_free_slot_the_line_waits_for_busy_slots_in_turn() -> None:
    # Slots free in 0.2 s and 0.5 s, mean hold 1 s; the router asks with N_max = 1 and leases
    # nothing. Line b c d e: b waits 0.2 (10.3 < 10.5, kept); c 0.5 (10.9 >= 10.6); d waits
    # 0.2 + 1 (11.4 >= 10.9); e 0.5 + 1 (11.55 >= 11.0): all three dropped at once.
    decision = get_batch_policy("adaptive-early-shed").decide(snap(1, (0.2, 0.5)), LINEAR_1MS)
    assert ids(decision.admitted) == ["b"]
    assert [d.request.request_id for d in decision.dropped] == ["a", "c", "d", "e"]
    assert decision.deferred == ()


def test_the_paper_policy_ignores_the_forecast() -> None:
    # Negative control: Algorithm 2 as written keeps c d e waiting whatever the slots say.
    decision = get_batch_policy("adaptive").decide(snap(1, (0.2, 0.5)), LINEAR_1MS)
    assert ids(decision.admitted) == ["b"]
    assert ids(decision.deferred) == ["c", "d", "e"]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.floats(0, 5), max_size=8))
def test_without_a_forecast_or_with_free_slots_it_decides_as_the_paper(
        max_requests: int, waits: list[float]) -> None:
    paper = get_batch_policy("adaptive").decide(snap(max_requests, ()), LINEAR_1MS)
    early = get_batch_policy("adaptive-early-shed").decide(snap(max_requests, ()), LINEAR_1MS)
    assert early == paper
    # Every request free now: nothing to shed beyond Algorithm 2's own drops.
    free = tuple(0.0 for _ in range(len(QUEUE)))
    assert get_batch_policy("adaptive-early-shed").decide(snap(max_requests, free),
                                                          LINEAR_1MS) == paper
    # With a forecast it only ever adds drops, never admits more.
    shed = get_batch_policy("adaptive-early-shed").decide(
        snap(max_requests, tuple(sorted(waits))), LINEAR_1MS)
    assert set(ids(shed.admitted)) <= set(ids(paper.admitted))
    assert {d.request.request_id for d in paper.dropped} <= {
        d.request.request_id for d in shed.dropped}

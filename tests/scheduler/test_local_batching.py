"""Local scheduler: Algorithm 2, FCFS and Moore-Hodgson on hand-checked queues, plus properties.

The hand cases use TTFT(R) = 1 ms per prompt token (a linear prefill curve through the origin,
one chunk of 1000 tokens), now = 10.0 s and a TTFT SLO of 1.0 s:

    id  arrival  tokens  deadline  now + TTFT alone
    a   9.2      300     10.2      10.3   (misses even alone)
    b   9.5      100     10.5      10.1
    c   9.6      400     10.6      10.4
    d   9.9      200     10.9      10.2
    e   10.0      50     11.0      10.05
"""

from __future__ import annotations

import pytest
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.local import (
    BATCH_POLICIES,
    BatchDecision,
    BatchLimits,
    QueueSnapshot,
    WaitingRequest,
    get_batch_policy,
)
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from hypothesis import given, settings
from hypothesis import strategies as st

from fineslab.errors import ConfigError

LINEAR_1MS = ChunkedPrefillPredictor(PiecewiseLinear.from_points([[0, 0.0], [1000, 1.0]]), 1000)
QUEUE = (
    WaitingRequest("a", 9.2, 300), WaitingRequest("b", 9.5, 100),
    WaitingRequest("c", 9.6, 400), WaitingRequest("d", 9.9, 200),
    WaitingRequest("e", 10.0, 50),
)


def ids(requests: tuple[WaitingRequest, ...]) -> list[str]:
    return [r.request_id for r in requests]


def snapshot(max_requests: int = 10, max_tokens: int = 10_000) -> QueueSnapshot:
    return QueueSnapshot(QUEUE, now_s=10.0, ttft_slo_s=1.0,
                         limits=BatchLimits(max_requests, max_tokens))


def test_adaptive_drops_removes_longest_and_trims_by_hand() -> None:
    decision = get_batch_policy("adaptive").decide(snapshot(max_requests=2), LINEAR_1MS)
    # a: 10.3 >= 10.2, dropped. EDF of the rest: b c d e, 750 tokens -> 10.75 >= 10.5 (b's
    # deadline): remove the longest, c (400) -> 350 tokens -> 10.35 < 10.5: stop. S = b d e;
    # trim to N_max = 2 -> b d, finishing at 10.3. c and e stay waiting.
    assert ids(decision.admitted) == ["b", "d"]
    assert [d.request.request_id for d in decision.dropped] == ["a"]
    assert "even alone" in decision.dropped[0].reason
    # Regression: the reason reaches the client in the router's 429; it named clock readings
    # ("now + TTFT = 10.3000 s >= deadline 10.2000 s"). Durations only: 0.30 s, 0.20 s.
    assert decision.dropped[0].reason == ("cannot meet its deadline even alone: its first token "
                                          "would take about 0.30 s and its deadline is 0.20 s "
                                          "away")
    assert ids(decision.deferred) == ["c", "e"]
    assert decision.predicted_finish_s == pytest.approx(10.3)


def test_adaptive_trim_by_tokens_keeps_the_edf_prefix() -> None:
    # After removal S = b(100) d(200) e(50); T_max = 250 keeps b only (b + d = 300 > 250),
    # even though e would fit: trim keeps a prefix of the EDF order.
    decision = get_batch_policy("adaptive").decide(snapshot(max_tokens=250), LINEAR_1MS)
    assert ids(decision.admitted) == ["b"]


def test_moore_hodgson_admits_a_batch_chunked_prefill_makes_late() -> None:
    # EDF a b c d e, completion times one at a time: a 10.3 > 10.2 -> evict a (0.3 s, the
    # longest) -> back to 10.0; b 10.1; c 10.5; d 10.7; e 10.75, all on time individually.
    decision = get_batch_policy("moore-hodgson").decide(snapshot(), LINEAR_1MS)
    assert ids(decision.admitted) == ["b", "c", "d", "e"]
    assert ids(decision.deferred) == ["a"] and decision.dropped == ()
    # Prefilled together by chunked prefill they all finish at 10.75, past b's 10.5.
    assert decision.predicted_finish_s == pytest.approx(10.75)


def test_fcfs_takes_arrival_order_up_to_n_max() -> None:
    decision = get_batch_policy("fcfs").decide(snapshot(max_requests=3), LINEAR_1MS)
    assert ids(decision.admitted) == ["a", "b", "c"]
    assert ids(decision.deferred) == ["d", "e"]


def test_head_longer_than_t_max_is_still_admitted_alone() -> None:
    snap = QueueSnapshot((WaitingRequest("long", 10.0, 800), WaitingRequest("x", 10.0, 10)),
                         now_s=10.0, ttft_slo_s=1.0, limits=BatchLimits(4, 500))
    decision = get_batch_policy("fcfs").decide(snap, LINEAR_1MS)
    assert ids(decision.admitted) == ["long"], "chunked prefill splits a long head"


def test_unknown_policy_and_bad_snapshot_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown batch policy"):
        get_batch_policy("lifo")
    with pytest.raises(ConfigError, match="unique"):
        QueueSnapshot((QUEUE[0], QUEUE[0]), 0.0, 1.0, BatchLimits(1, 1))


requests_st = st.lists(
    st.builds(WaitingRequest, request_id=st.just(""),
              arrival_s=st.floats(0.0, 10.0), prompt_tokens=st.integers(1, 4000)),
    max_size=40,
).map(lambda rs: tuple(WaitingRequest(f"r{i}", r.arrival_s, r.prompt_tokens)
                       for i, r in enumerate(rs)))
predictor_st = st.builds(
    lambda base_s, per_token_s, chunk: ChunkedPrefillPredictor(
        PiecewiseLinear.from_points([[0, base_s], [2048, base_s + 2048 * per_token_s]]), chunk),
    st.floats(0.0, 0.05), st.floats(1e-5, 1e-3), st.integers(64, 4096))
snapshot_st = st.builds(QueueSnapshot, requests_st, st.floats(5.0, 12.0), st.floats(0.05, 5.0),
                        st.builds(BatchLimits, st.integers(1, 64), st.integers(1, 16384)))


def check_partition(snap: QueueSnapshot, decision: BatchDecision) -> None:
    seen = ids(decision.admitted) + ids(decision.deferred) + [
        d.request.request_id for d in decision.dropped]
    assert sorted(seen) == sorted(ids(snap.requests)), "every request decided exactly once"
    assert len(decision.admitted) <= snap.limits.max_requests
    if len(decision.admitted) > 1:
        assert sum(r.prompt_tokens for r in decision.admitted) <= snap.limits.max_batched_tokens


@settings(max_examples=200, deadline=None)
@given(snapshot_st, predictor_st)
def test_adaptive_batch_meets_its_earliest_deadline(snap: QueueSnapshot,
                                                    predictor: ChunkedPrefillPredictor) -> None:
    decision = get_batch_policy("adaptive").decide(snap, predictor)
    check_partition(snap, decision)
    if decision.admitted:
        earliest_s = min(r.deadline_s(snap.ttft_slo_s) for r in decision.admitted)
        assert decision.predicted_finish_s is not None
        assert decision.predicted_finish_s < earliest_s, "admitted batch misses its deadline"
    for dropped in decision.dropped:
        alone_s = snap.now_s + predictor.ttft_s([dropped.request.prompt_tokens])
        assert alone_s >= dropped.request.deadline_s(snap.ttft_slo_s), "dropped but feasible"


@settings(max_examples=100, deadline=None)
@given(snapshot_st, predictor_st, st.sampled_from(sorted(BATCH_POLICIES)))
def test_every_policy_partitions_the_queue_within_limits(
        snap: QueueSnapshot, predictor: ChunkedPrefillPredictor, name: str) -> None:
    check_partition(snap, get_batch_policy(name).decide(snap, predictor))

"""The drop margin learned from first tokens, and its peer policies (issue #38).

The hand cases use test_local_batching's predictor (1 ms per prompt token, chunks of 1,000),
now = 10.0 s and a TTFT SLO of 1.0 s; a request arriving at 10.0 s has 1.0 s left:

    tokens  predicted  x its deadline distance  paper      margin learned at c = 0.5
    1500    1.5 s      1.5                      dropped    kept (0.75 s < 1.0 s), admitted
    3000    3.0 s      3.0                      dropped    dropped (1.5 s >= 1.0 s)
"""

from __future__ import annotations

import dataclasses

import pytest
from fineslab.scheduler.local import (
    BatchLimits,
    DropMargin,
    MarginBatchPolicy,
    MarginConfig,
    QueueSnapshot,
    WaitingRequest,
    get_batch_policy,
    margin_of,
)
from fineslab.scheduler.local.adaptive import AdaptiveBatchPolicy
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.refreshed import HALF_LIFE_S
from hypothesis import given, settings
from hypothesis import strategies as st

from fineslab.errors import ConfigError
from tests.scheduler.test_local_batching import LINEAR_1MS, ids, predictor_st, snapshot_st

MIN = MarginConfig().min_samples
WINDOW = MarginConfig().window


def taught(ratio: float, count: int = MIN, at_s: float = 10.0,
           margin: DropMargin | None = None) -> DropMargin:
    """A margin that saw `count` first tokens, each `ratio` x its prediction, at `at_s`."""
    margin = margin or DropMargin()
    for _ in range(count):
        assert margin.observe(1.0, ratio, at_s)
    return margin


def alone(tokens: int) -> QueueSnapshot:
    return QueueSnapshot((WaitingRequest("x", 10.0, tokens),), 10.0, 1.0, BatchLimits(8, 10_000))


def dropped(decision: object) -> list[str]:
    return [d.request.request_id for d in decision.dropped]  # type: ignore[attr-defined]


# -- the learner ---------------------------------------------------------------------------------

def test_no_ratio_or_too_few_leave_the_prediction_as_it_is() -> None:
    assert DropMargin().correction(10.0) == 1.0
    assert taught(0.5, MIN - 1).correction(10.0) == 1.0, "acts only from min_samples on"
    assert taught(0.5, MIN).correction(10.0) == pytest.approx(0.5)


def test_a_consistent_twofold_over_prediction_is_learned_as_one_half() -> None:
    assert taught(0.5, WINDOW).correction(10.0) == pytest.approx(0.5)


def test_an_under_predicting_predictor_is_never_loosened_nor_tightened() -> None:
    """Ratios above 1 (first tokens later than predicted) leave c at 1: the margin never
    drops more than the policy it wraps."""
    assert taught(2.0, WINDOW).correction(10.0) == 1.0
    mixed = taught(3.0, 8, margin=taught(0.5, WINDOW - 8))
    assert mixed.correction(10.0) == 1.0, "the high quantile sees the late ones"


def test_the_correction_is_clamped_at_the_floor() -> None:
    assert taught(0.01, WINDOW).correction(10.0) == MarginConfig().floor
    assert taught(0.0, WINDOW).correction(10.0) == MarginConfig().floor


def test_the_high_quantile_lets_the_slowest_few_not_more_hold_it_back() -> None:
    """q = 0.95 over 64 ratios is the 61st smallest: three late ones (5%) do not hold the
    correction at 1; four do."""
    three = taught(1.0, 3, margin=taught(0.5, WINDOW - 3))
    assert three.correction(10.0) == pytest.approx(0.5)
    four = taught(1.0, 4, margin=taught(0.5, WINDOW - 4))
    assert four.correction(10.0) == 1.0


def test_only_the_latest_window_counts() -> None:
    margin = taught(1.0, WINDOW, margin=taught(0.5, WINDOW))
    assert margin.samples == WINDOW and margin.correction(10.0) == 1.0
    margin = taught(0.5, WINDOW, margin=taught(1.0, WINDOW))
    assert margin.correction(10.0) == pytest.approx(0.5)


def test_a_stale_margin_fades_back_to_the_prediction_as_given() -> None:
    margin = taught(0.25, WINDOW, at_s=0.0)
    assert margin.correction(0.0) == pytest.approx(0.25)
    assert margin.correction(HALF_LIFE_S) == pytest.approx(0.5), "its log halves"
    assert margin.correction(20 * HALF_LIFE_S) == pytest.approx(1.0, abs=1e-4)
    # A new first token does not bring the old ratios back: they stay faded.
    taught(1.0, 1, at_s=20 * HALF_LIFE_S, margin=margin)
    assert margin.correction(20 * HALF_LIFE_S) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(("predicted_s", "real_s"), [
    (0.0, 1.0), (-1.0, 1.0), (1.0, -0.1), (float("nan"), 1.0), (1.0, float("inf"))])
def test_a_sample_without_a_positive_prediction_and_a_real_time_is_ignored(
        predicted_s: float, real_s: float) -> None:
    margin = DropMargin()
    assert not margin.observe(predicted_s, real_s, 10.0)
    assert margin.samples == 0


@pytest.mark.parametrize("fields", [
    {"window": 0}, {"min_samples": 0}, {"min_samples": 65}, {"quantile": 0.0},
    {"quantile": 1.5}, {"floor": 0.0}, {"floor": 1.5}, {"half_life_s": 0.0}])
def test_a_margin_config_out_of_range_is_a_config_error(fields: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="drop margin"):
        MarginConfig(**fields)  # type: ignore[arg-type]


# -- the peer policies ---------------------------------------------------------------------------

def test_the_peers_are_chosen_by_name_and_the_papers_policies_learn_nothing() -> None:
    for name in ("adaptive-margin", "adaptive-early-shed-margin"):
        policy = get_batch_policy(name)
        assert policy.name == name and margin_of(policy) is not None
        assert margin_of(get_batch_policy(name)) is not margin_of(policy), "one margin each"
    for name in ("adaptive", "adaptive-early-shed", "fcfs", "moore-hodgson"):
        assert margin_of(get_batch_policy(name)) is None


@pytest.mark.parametrize("name", ["adaptive", "adaptive-early-shed"])
def test_a_learned_margin_keeps_and_admits_what_the_paper_drops_and_drops_the_rest(
        name: str) -> None:
    paper = get_batch_policy(name)
    peer = MarginBatchPolicy(paper, taught(0.5, WINDOW))
    assert dropped(paper.decide(alone(1500), LINEAR_1MS)) == ["x"]
    kept = peer.decide(alone(1500), LINEAR_1MS)
    # Admitted, not only kept: the admission test reads the corrected prediction too, or the
    # request would be deferred to its deadline and never served.
    assert ids(kept.admitted) == ["x"] and not kept.dropped
    assert kept.predicted_finish_s == pytest.approx(10.75)
    assert dropped(peer.decide(alone(3000), LINEAR_1MS)) == ["x"]
    assert "about 1.25 s" in MarginBatchPolicy(paper, taught(0.5, WINDOW)).decide(
        alone(2500), LINEAR_1MS).dropped[0].reason, "the reason names the corrected TTFT"


@settings(max_examples=150, deadline=None)
@given(snapshot_st, predictor_st, st.lists(st.floats(0.0, 1.0), max_size=8))
def test_with_no_margin_learned_each_peer_decides_exactly_as_the_paper(
        snap: QueueSnapshot, predictor: ChunkedPrefillPredictor, slots: list[float]) -> None:
    snap = dataclasses.replace(snap, slot_free_in_s=tuple(sorted(slots)), mean_service_s=0.5)
    for name in ("adaptive", "adaptive-early-shed"):
        assert get_batch_policy(f"{name}-margin").decide(snap, predictor) == \
            get_batch_policy(name).decide(snap, predictor), name
    under = MarginBatchPolicy(AdaptiveBatchPolicy(), taught(1.5, WINDOW))
    assert under.decide(snap, predictor) == AdaptiveBatchPolicy().decide(snap, predictor)


@settings(max_examples=150, deadline=None)
@given(snapshot_st, predictor_st, st.floats(0.0, 1.0))
def test_over_algorithm_2_the_margin_drops_a_subset_of_the_papers_drops(
        snap: QueueSnapshot, predictor: ChunkedPrefillPredictor, ratio: float) -> None:
    paper = AdaptiveBatchPolicy().decide(snap, predictor)
    peer = MarginBatchPolicy(AdaptiveBatchPolicy(), taught(ratio, WINDOW, at_s=snap.now_s))
    assert set(dropped(peer.decide(snap, predictor))) <= set(dropped(paper))

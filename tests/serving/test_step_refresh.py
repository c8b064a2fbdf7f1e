"""The engine policy's predictor refreshed from timed prefill steps (`step_refresh.py`), without
a runtime: the scale per step size, the bounds, which loop iterations count as a step, and the
policy deciding differently once it has timed steps. In a real SGLang server:
tests/sglang_plugin/test_engine_policy.py (refreshed and as-given side by side)."""

from __future__ import annotations

import itertools
import logging
import math
from types import SimpleNamespace

import pytest
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.predictors import ChunkedPrefillPredictor

from fineslab.errors import ConfigError
from fineslab.sglang_plugin.config import EngineSchedule
from fineslab.sglang_plugin.engine_policy import EngineBatchPolicy
from fineslab.sglang_plugin.step_refresh import (
    ALPHA,
    MAX_RATIO,
    MIN_SAMPLES,
    RefreshedPredictor,
    StepClock,
    bucket_of,
)

#: 1 s per 100 tokens, chunks of 100.
BASE = ChunkedPrefillPredictor(PiecewiseLinear((0.0, 100.0), (0.0, 1.0)), 100)


def _frozen() -> float:
    """A wall clock that stands still: no scale ages (test_aging.py ages them)."""
    return 0.0


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 100, 128)] == [0, 1, 1, 2, 2, 3, 6, 7]


def test_before_any_step_the_profile_is_used_as_given() -> None:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    assert predictor.ttft_s([250]) == pytest.approx(BASE.ttft_s([250]))


def test_steps_twice_as_fast_halve_every_prediction() -> None:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    for _ in range(5):
        predictor.observe(100, 0.5)
    assert predictor.scale(100) == pytest.approx(0.5)
    assert predictor.ttft_s([250]) == pytest.approx(0.5 * BASE.ttft_s([250]))


def test_a_size_with_its_own_steps_gets_its_own_scale_others_the_overall_one() -> None:
    """Small steps carry a fixed cost the profile charges differently: after MIN_SAMPLES steps
    of 4 tokens the 4-token bucket has its own scale; 50-token steps, never timed, use the
    overall mean until their bucket has enough steps of its own."""
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    for _ in range(MIN_SAMPLES):
        predictor.observe(4, 0.04 * 3)  # 3x the profile's 0.04 s
    for _ in range(MIN_SAMPLES):
        predictor.observe(100, 0.5)  # 0.5x
    assert predictor.scale(4) == pytest.approx(3.0)
    assert predictor.scale(100) == pytest.approx(0.5)
    overall = predictor.scale(50)
    assert 0.5 < overall < 3.0 and overall == pytest.approx(math.exp(
        predictor.overall.log_scale))


def test_the_refreshed_ttft_never_shrinks_as_tokens_are_added() -> None:
    """Steps of 40 tokens measured at 3x the profile, of 100 at 0.5x: alone, the bucket scales
    would make 64 tokens (0.32 s) quicker than 63 (1.89 s). The floor keeps every prediction
    at least that of fewer tokens (Algorithm 2 relies on it), at the cost of predicting the
    64-127 bucket no quicker than 63 tokens."""
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    for _ in range(MIN_SAMPLES):
        predictor.observe(40, 0.4 * 3)
        predictor.observe(100, 1.0 * 0.5)
    assert predictor.scale(63) == pytest.approx(3.0) and predictor.scale(64) == pytest.approx(0.5)
    times = [predictor.ttft_s([n]) for n in range(0, 450)]
    assert all(b >= a for a, b in itertools.pairwise(times)), "monotone in tokens"
    assert predictor.step_s(64) == pytest.approx(3 * 0.63)
    assert predictor.step_s(100) == pytest.approx(3 * 0.63)


def test_the_chunks_own_steps_are_not_overridden_by_the_mean_of_other_sizes() -> None:
    """A runtime that ran short steps slowly (ten 4-token steps at 2x the profile: a fixed
    cost, or a machine busy with other work) and then MIN_SAMPLES 100-token chunks at 0.2x:
    a chunk is predicted at its own 0.2 s, not at the overall mean (still pulled up by the
    short steps) of the never-timed 32-63-token bucket below it, which is held under the
    chunk instead; the TTFT still never shrinks as tokens are added."""
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    for _ in range(10):
        predictor.observe(4, 0.04 * 2)
    for _ in range(MIN_SAMPLES):
        predictor.observe(100, 1.0 * 0.2)
    assert math.exp(predictor.overall.log_scale) > 0.5, "the overall mean is still high"
    assert predictor.step_s(100) == pytest.approx(0.2)
    assert predictor.ttft_s([300]) == pytest.approx(0.6)
    assert predictor.step_s(63) <= predictor.step_s(64) <= predictor.step_s(100)
    times = [predictor.ttft_s([n]) for n in range(0, 450)]
    assert all(b >= a for a, b in itertools.pairwise(times)), "monotone in tokens"


def test_one_outlier_step_moves_the_scale_by_a_bounded_factor() -> None:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    for _ in range(10):
        predictor.observe(100, 1.0)
    predictor.observe(100, 1e6)  # a step stalled for days
    assert predictor.scale(100) == pytest.approx(MAX_RATIO ** ALPHA)
    for _ in range(200):
        predictor.observe(100, 1e6)
    assert predictor.scale(100) == pytest.approx(MAX_RATIO)


@pytest.mark.parametrize("tokens, seconds", [(0, 1.0), (100, 0.0), (100, -1.0),
                                             (100, float("nan")), (100, float("inf"))])
def test_a_step_without_a_positive_time_is_ignored(tokens: int, seconds: float) -> None:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    predictor.observe(tokens, seconds)
    assert predictor.overall.samples == 0 and predictor.scale(100) == 1.0


def test_the_scale_is_logged_when_it_moves(caplog: pytest.LogCaptureFixture) -> None:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    with caplog.at_level(logging.INFO, logger="fineslab.scheduler.refreshed"):
        predictor.observe(100, 1.05)  # within LOG_FACTOR of 1: quiet
        assert not caplog.records
        predictor.observe(100, 4.0)
    assert any("prefill steps run at" in r.getMessage() for r in caplog.records)


def test_a_step_counts_only_when_exactly_one_batch_ran_in_between() -> None:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    clock = StepClock(predictor)
    clock.batch_formed(SimpleNamespace(extend_num_tokens=100), forward_ct=7, now_s=10.0)
    clock.loop_came_back(forward_ct=9, now_s=12.0)  # a decode ran too: not a step
    assert predictor.overall.samples == 0
    clock.batch_formed(None, forward_ct=9, now_s=12.0)  # no prefill this iteration
    clock.loop_came_back(forward_ct=10, now_s=12.5)
    assert predictor.overall.samples == 0
    clock.batch_formed(SimpleNamespace(extend_num_tokens=100), forward_ct=10, now_s=13.0)
    clock.loop_came_back(forward_ct=11, now_s=13.25)
    assert predictor.overall.samples == 1 and predictor.scale(100) == pytest.approx(0.25)


def _req(rid: str, tokens: int, deadline_ms: int) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=[1] * tokens, output_ids=[],
                           priority=deadline_ms, prefix_len=0)


def _scheduler(queue: list[SimpleNamespace]) -> SimpleNamespace:
    scheduler = SimpleNamespace(waiting_queue=queue, chunked_req=None, max_running_requests=8,
                                max_prefill_tokens=4096, tp_size=1, forward_ct=0, aborted=[],
                                token_to_kv_pool_allocator=SimpleNamespace(
                                    available_size=lambda: 10_000),
                                tree_cache=SimpleNamespace(evictable_size=lambda: 0))

    def abort_request(recv_req: SimpleNamespace) -> None:
        scheduler.aborted.append(recv_req.rid)
        scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r.rid != recv_req.rid]

    scheduler.abort_request = abort_request
    return scheduler


def _run_steps(policy: EngineBatchPolicy, scheduler: SimpleNamespace, now: list[float],
               steps: int, step_s: float) -> None:
    """`steps` loop iterations, each forming a 100-token prefill that takes `step_s`."""
    def former(sched: SimpleNamespace, *args: object, **kwargs: object) -> tuple:
        return SimpleNamespace(extend_num_tokens=100), None

    for _ in range(steps):
        policy.around(former, scheduler)
        scheduler.forward_ct += 1
        now[0] += step_s


@pytest.mark.parametrize("refresh, dropped", [(True, []), (False, ["r"])])
def test_a_policy_that_timed_fast_steps_admits_what_the_stale_profile_drops(
        refresh: bool, dropped: list[str]) -> None:
    """A 250-token request with 2 s to its deadline: the profile says 2.5 s (dropped). After
    the runtime has timed five 100-token steps at 0.2 s, the refreshed policy predicts 0.5 s
    and admits it; with refresh off (the control) it is still dropped."""
    now = [100.0]
    schedule = EngineSchedule.for_model("adaptive", 2.0, BASE, refresh=refresh)
    policy = EngineBatchPolicy(schedule, clock=lambda: 1000.0, step_clock=lambda: now[0])
    scheduler = _scheduler([])
    _run_steps(policy, scheduler, now, 6, 0.2)
    scheduler.waiting_queue = [_req("r", 250, 1_002_000)]
    policy.around(lambda s, *a, **k: (None, None), scheduler)
    assert scheduler.aborted == dropped


def test_the_work_ahead_leaves_out_the_chunk_the_last_step_prefilled() -> None:
    """A 1,000-token prompt whose second chunk (tokens 100-199) was just prefilled: SGLang
    still says prefix_len 100 until it forms the next chunk. A request behind it waits for
    800 tokens (8 steps of the profile's 1 s), not 900."""
    scheduler = _scheduler([_req("short", 10, 1_005_000)])
    scheduler.chunked_req = SimpleNamespace(origin_input_ids=[1] * 1000, prefix_len=100,
                                            extend_end=200, rid="long")
    messages: list[str] = []
    abort = scheduler.abort_request
    scheduler.abort_request = lambda r: (messages.append(r.finished_reason["message"]), abort(r))
    policy = EngineBatchPolicy(EngineSchedule.for_model("adaptive", 2.0, BASE, refresh=False),
                               clock=lambda: 1000.0)
    policy.around(lambda s, *a, **k: (None, None), scheduler)
    assert scheduler.aborted == ["short"]
    assert "about 8.10 s behind 800 prompt tokens" in messages[0], messages


def test_a_scheduler_without_a_step_count_turns_the_refresh_off_and_keeps_deciding(
        caplog: pytest.LogCaptureFixture) -> None:
    scheduler = _scheduler([_req("late", 300, 999_000)])
    del scheduler.forward_ct
    policy = EngineBatchPolicy(EngineSchedule.for_model("adaptive", 2.0, BASE),
                               clock=lambda: 1000.0)
    with caplog.at_level(logging.ERROR):
        policy.around(lambda s, *a, **k: (None, None), scheduler)
    assert policy.steps is None and scheduler.aborted == ["late"]
    assert any("timing prefill steps failed" in r.getMessage() for r in caplog.records)


def test_the_refresh_switch_travels_in_the_environment() -> None:
    for refresh in (True, False):
        schedule = EngineSchedule.for_model("adaptive", 2.0, BASE, refresh=refresh)
        assert EngineSchedule.from_env(schedule.environ()) == schedule
    raw = schedule.environ()["FINESLAB_ENGINE_POLICY"].replace("false", '"no"')
    with pytest.raises(ConfigError, match="refresh must be true or false"):
        EngineSchedule.from_env({"FINESLAB_ENGINE_POLICY": raw})

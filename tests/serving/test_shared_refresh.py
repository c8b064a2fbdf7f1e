"""One predictor for the router's gate and the engine (issue #18 item 1): a runtime's engine
policy writes the scales of its refreshed predictor to a file, and the router's gate for the
model (`FollowedPredictor`) decides with the same profile scaled by its runtimes' files
(scheduler/refreshed.py). The real runtime writing its file is in test_engine_policy.py."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.local import BatchLimits, QueueSnapshot, WaitingRequest, get_batch_policy
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.refreshed import (
    HALF_LIFE_S,
    MAX_RATIO,
    PUBLISH_S,
    FollowedPredictor,
    RefreshedPredictor,
    read_scales,
    write_scales,
)

from fineslab.errors import ConfigError
from fineslab.sglang_plugin.config import EngineSchedule
from fineslab.sglang_plugin.engine_policy import EngineBatchPolicy

#: 1 s per 100 tokens, chunks of 100.
BASE = ChunkedPrefillPredictor(PiecewiseLinear((0.0, 100.0), (0.0, 1.0)), 100)


def _frozen() -> float:
    """A wall clock that stands still: no scale ages (the aging tests at the end age them)."""
    return 0.0


def _timed(step_s: float, steps: int = 5, tokens: int = 100) -> RefreshedPredictor:
    predictor = RefreshedPredictor(BASE, clock=_frozen)
    for _ in range(steps):
        predictor.observe(tokens, step_s)
    return predictor


def test_the_gate_predicts_what_the_runtime_predicts_from_its_file(tmp_path: Path) -> None:
    runtime = _timed(0.25)
    write_scales(tmp_path / "r0.steps.json", runtime)
    gate = FollowedPredictor(BASE, (tmp_path / "r0.steps.json",), wall=_frozen)
    for tokens in (1, 50, 100, 250, 1000):
        assert gate.prefill_tokens_s(tokens) == pytest.approx(runtime.prefill_tokens_s(tokens))
    assert gate.ttft_s([250]) == pytest.approx(0.25 * BASE.ttft_s([250]))
    assert gate.chunk_tokens == BASE.chunk_tokens


def test_replicas_scales_are_merged_by_their_samples(tmp_path: Path) -> None:
    """One replica timed 3 steps at 4x the profile, the other 1 step at 1/4: the gate's
    scale is exp((3 log 4 + 1 log 1/4) / 4) = 2 (the all-steps mean; the bucket with 4
    samples is past MIN_SAMPLES)."""
    write_scales(tmp_path / "a.steps.json", _timed(4.0, steps=3))
    write_scales(tmp_path / "b.steps.json", _timed(0.25, steps=1))
    gate = FollowedPredictor(BASE, (tmp_path / "a.steps.json", tmp_path / "b.steps.json"),
                             wall=_frozen)
    assert gate.current().scale(100) == pytest.approx(2.0)
    assert gate.current().overall.samples == 4


@pytest.mark.parametrize("content", [None, "{not json", '{"overall": [0.5, 3]}',
                                     '{"overall": [NaN, 3], "buckets": {}}',
                                     '{"overall": [0.5, -1], "buckets": {}}',
                                     '{"overall": [0.5, 3], "buckets": {"x": [0.5, 3]}}',
                                     '[1, 2]'])
def test_a_missing_or_malformed_file_leaves_the_profile_as_given(
        tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "r0.steps.json"
    if content is not None:
        path.write_text(content)
    assert read_scales(path) is None
    gate = FollowedPredictor(BASE, (path,), wall=_frozen)
    assert gate.ttft_s([250]) == pytest.approx(BASE.ttft_s([250]))


def test_a_merged_scale_stays_within_the_bounds(tmp_path: Path) -> None:
    path = tmp_path / "r0.steps.json"
    path.write_text(json.dumps({"overall": [100.0, 5], "buckets": {}}))
    gate = FollowedPredictor(BASE, (path,), wall=_frozen)
    assert gate.current().scale(100) == pytest.approx(MAX_RATIO)


def test_the_gate_rereads_the_files_at_most_every_publish_s(tmp_path: Path) -> None:
    path = tmp_path / "r0.steps.json"
    now = [0.0]
    gate = FollowedPredictor(BASE, (path,), clock=lambda: now[0], wall=_frozen)
    assert gate.ttft_s([100]) == pytest.approx(1.0), "no file yet: as profiled"
    write_scales(path, _timed(0.5))
    now[0] += PUBLISH_S / 2
    assert gate.ttft_s([100]) == pytest.approx(1.0), "read again only after PUBLISH_S"
    now[0] += PUBLISH_S / 2
    assert gate.ttft_s([100]) == pytest.approx(0.5)


def _scheduler() -> SimpleNamespace:
    return SimpleNamespace(waiting_queue=[], chunked_req=None, max_running_requests=8,
                           max_prefill_tokens=4096, tp_size=1, forward_ct=0)


def _steps(policy: EngineBatchPolicy, scheduler: SimpleNamespace, now: list[float],
           steps: int, step_s: float) -> None:
    for _ in range(steps):
        policy.around(lambda s, *a, **k: (SimpleNamespace(extend_num_tokens=100), None),
                      scheduler)
        scheduler.forward_ct += 1
        now[0] += step_s


def test_the_engine_publishes_its_scales_once_steps_are_timed_and_not_more_often(
        tmp_path: Path) -> None:
    path = tmp_path / "r0.steps.json"
    now = [100.0]
    schedule = EngineSchedule.for_model("adaptive", 2.0, BASE, publish=str(path))
    policy = EngineBatchPolicy(schedule, clock=lambda: 1000.0, step_clock=lambda: now[0])
    scheduler = _scheduler()
    policy.around(lambda s, *a, **k: (None, None), scheduler)
    assert not path.exists(), "nothing timed yet: nothing written"
    _steps(policy, scheduler, now, 3, 0.1)  # two steps timed, 0.1 s apart: one write
    first = read_scales(path)
    assert first is not None and first["overall"][1] == 1
    _steps(policy, scheduler, now, 4, 0.2)  # 0.8 s more: written again
    doc = read_scales(path)
    assert doc is not None and doc["overall"][1] > first["overall"][1]
    gate = FollowedPredictor(BASE, (path,), wall=lambda: 1000.0)
    policy.predictor.observe(100, 0.1)  # not yet written: the gate reads the last file
    assert gate.ttft_s([100]) == pytest.approx(math.exp(doc["overall"][0]), rel=1e-6)


def test_no_publish_path_writes_nothing_and_a_failed_write_stops_publishing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    quiet = EngineBatchPolicy(EngineSchedule.for_model("adaptive", 2.0, BASE),
                              clock=lambda: 1000.0, step_clock=lambda: now[0])
    _steps(quiet, _scheduler(), now, 4, 0.3)
    assert list(tmp_path.iterdir()) == []
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the folder should be")
    schedule = EngineSchedule.for_model("adaptive", 2.0, BASE,
                                        publish=str(blocked / "r0.steps.json"))
    policy = EngineBatchPolicy(schedule, clock=lambda: 1000.0, step_clock=lambda: now[0])
    scheduler = _scheduler()
    with caplog.at_level(logging.ERROR):
        _steps(policy, scheduler, now, 6, 0.3)
    assert policy.schedule.publish is None and policy.steps is not None, \
        "publishing stops; the refresh and the scheduler go on"
    assert sum("cannot write the step scales" in r.getMessage() for r in caplog.records) == 1


def test_the_publish_path_travels_in_the_environment() -> None:
    schedule = EngineSchedule.for_model("adaptive", 2.0, BASE, publish="/tmp/x.steps.json")
    assert EngineSchedule.from_env(schedule.environ()) == schedule
    raw = schedule.environ()["FINESLAB_ENGINE_POLICY"].replace('"/tmp/x.steps.json"', "7")
    with pytest.raises(ConfigError, match="publish must be a file path"):
        EngineSchedule.from_env({"FINESLAB_ENGINE_POLICY": raw})


# -- aging: a scale no step refreshes fades back to the profile ---------------------------------

def _aging(step_s: float, steps: int = 5) -> tuple[RefreshedPredictor, list[float]]:
    wall = [0.0]
    predictor = RefreshedPredictor(BASE, clock=lambda: wall[0])
    for _ in range(steps):
        predictor.observe(100, step_s)
    return predictor, wall


def test_a_scale_no_step_refreshes_fades_back_to_the_profile() -> None:
    predictor, wall = _aging(4.0)  # steps at 4x the profile
    assert predictor.scale(100) == pytest.approx(4.0)
    wall[0] += HALF_LIFE_S
    predictor.age()
    assert predictor.scale(100) == pytest.approx(2.0), "half the log scale"
    assert predictor.ttft_s([100]) == pytest.approx(2.0)
    wall[0] += 10 * HALF_LIFE_S
    predictor.age()
    assert predictor.scale(100) == pytest.approx(1.0, rel=2e-3)
    predictor.observe(100, 4.0)  # a step: the machine is slow again, and it shows
    assert predictor.scale(100) > 1.3


def test_steps_that_keep_coming_keep_their_scale() -> None:
    """Aging bites only when no step comes: a step every 50 ms keeps a 4x scale at 4x."""
    predictor, wall = _aging(4.0)
    for _ in range(400):
        wall[0] += 0.05
        predictor.age()
        predictor.observe(100, 4.0)
    assert predictor.scale(100) == pytest.approx(4.0, rel=0.01)


def _alone_drops(gate: FollowedPredictor) -> int:
    """How many of one 100-token request (SLO 2 s) Algorithm 2 drops "even alone"."""
    snapshot = QueueSnapshot((WaitingRequest("r", 0.0, 100),), 0.0, 2.0, BatchLimits(8, 4096))
    return len(get_batch_policy("adaptive").decide(snapshot, gate).dropped)


def test_a_gate_taught_to_drop_everything_alone_lets_requests_through_once_it_is_old(
        tmp_path: Path) -> None:
    """The lockout: a runtime timed its steps at 8x while the machine was loaded; its gate
    then dropped every request "even alone" (8 s for a 2 s SLO), so no step was timed again
    and, without aging, it would drop them for ever. Three half-lives later (8 ** (1/8) =
    1.3x) the request goes through; the file as just written is the control."""
    path = tmp_path / "r0.steps.json"
    runtime, _ = _aging(8.0)
    write_scales(path, runtime)
    now = [0.0]
    gate = FollowedPredictor(BASE, (path,), clock=lambda: now[0], wall=lambda: now[0])
    assert _alone_drops(gate) == 1
    now[0] += 3 * HALF_LIFE_S
    assert gate.ttft_s([100]) == pytest.approx(8.0 ** (1 / 8))
    assert _alone_drops(gate) == 0


def test_a_file_of_the_two_field_shape_is_read_and_never_aged(tmp_path: Path) -> None:
    path = tmp_path / "r0.steps.json"
    path.write_text(json.dumps({"overall": [math.log(4.0), 5],
                                "buckets": {"6": [math.log(4.0), 5]}}))
    gate = FollowedPredictor(BASE, (path,), wall=lambda: 1e9)
    assert gate.current().scale(100) == pytest.approx(4.0)


def test_the_engine_ages_its_own_scales_between_steps(tmp_path: Path) -> None:
    wall, now = [1000.0], [100.0]
    policy = EngineBatchPolicy(EngineSchedule.for_model("adaptive", 2.0, BASE),
                               clock=lambda: wall[0], step_clock=lambda: now[0])
    scheduler = _scheduler()
    _steps(policy, scheduler, now, 6, 0.4)  # 100-token steps at 0.4x the profile
    idle = lambda s, *a, **k: (None, None)  # noqa: E731 (a turn of the loop, no batch)
    policy.around(idle, scheduler)  # the last step ends
    assert policy.predictor.scale(100) == pytest.approx(0.4)
    wall[0] += 2 * HALF_LIFE_S
    now[0] += PUBLISH_S
    policy.around(idle, scheduler)
    assert policy.predictor.scale(100) == pytest.approx(0.4 ** 0.25)

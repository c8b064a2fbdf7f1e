"""The engine schedule's plumbing, without a runtime (issue #18, item 1): the config switch, the
variable a runtime gets, the body the router sends (deadline in `priority`, a client's own
`priority` removed), the router's answer to an engine drop, and the policy's own pieces. The
policy deciding inside a real SGLang server: tests/sglang_plugin/test_engine_policy.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.local import ENGINE_DROP_PREFIX, get_batch_policy
from fineslab.scheduler.predictors import ChunkedPrefillPredictor

from fineslab.bench.engine_policy import EngineBenchConfig, _modes, fleet_config
from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.plan import make_plan
from fineslab.fleet.runtimes import server_spec
from fineslab.quant.serving import PrecisionRuntime
from fineslab.router.metrics import RouterMetrics
from fineslab.router.proxy import engine_dropped, runtime_body
from fineslab.router.queues import Lease, ModelQueue
from fineslab.router.routes import ModelRoute, ReplicaRoute, RouterSettings
from fineslab.sglang_plugin.config import EngineSchedule
from fineslab.sglang_plugin.engine_policy import (
    AheadPredictor,
    EngineBatchPolicy,
    deadline_from_priority,
    drop_reason,
)
from fineslab.slabs import KVDtype

REPO = Path(__file__).resolve().parents[2]
PREDICTOR = ChunkedPrefillPredictor(PiecewiseLinear((0.0, 100.0), (0.0, 1.0)), 100)
SCHEDULE = EngineSchedule.for_model("adaptive", 2.0, PREDICTOR)


def _demo(**top: object) -> dict:
    data = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())
    data.update(top)
    return data


def test_local_scheduler_engine_puts_the_schedule_in_each_runtime_environment() -> None:
    config = fleet_from_dict(_demo(local_scheduler="engine"), "t.yaml")
    assert config.local_scheduler == "engine"
    runtime = make_plan(config).runtimes_of("llama-bf16")[0]
    prepared = PrecisionRuntime("llama-bf16", "bf16", Path(runtime.model_dir), KVDtype.BF16, ())
    spec = server_spec(runtime, prepared, "f", use_arena=True, schedule=SCHEDULE)
    assert EngineSchedule.from_env(spec.env) == SCHEDULE
    plain = server_spec(runtime, prepared, "f", use_arena=True)
    assert EngineSchedule.from_env(plain.env) is None
    assert fleet_from_dict(_demo(), "t.yaml").local_scheduler == "router"


def test_local_scheduler_refuses_unknown_values_and_tp_above_one() -> None:
    with pytest.raises(ConfigError, match="local_scheduler"):
        fleet_from_dict(_demo(local_scheduler="gpu"), "t.yaml")
    data = _demo(local_scheduler="engine")
    data["models"][0]["tp"] = 2
    with pytest.raises(ConfigError, match="local_scheduler: engine serves tp: 1"):
        fleet_from_dict(data, "t.yaml")


@pytest.mark.parametrize("raw", ["{", "[]", '{"policy": "adaptive"}',
                                 '{"policy": "nope", "ttft_slo_s": 1, "chunk_tokens": 8, '
                                 '"prefill_s": [[0, 0], [8, 1]]}',
                                 '{"policy": "adaptive", "ttft_slo_s": -1, "chunk_tokens": 8, '
                                 '"prefill_s": [[0, 0], [8, 1]]}',
                                 '{"policy": "adaptive", "ttft_slo_s": 1, "chunk_tokens": 0, '
                                 '"prefill_s": [[0, 0], [8, 1]]}'])
def test_a_malformed_engine_schedule_is_a_config_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError):
        EngineSchedule.from_env({"FINESLAB_ENGINE_POLICY": raw})


def _route(engine: bool) -> ModelRoute:
    return ModelRoute("m", (ReplicaRoute("m-0", "http://x"),), 2.0, PREDICTOR, None, 4096,
                      engine_deadlines=engine)


def _lease(arrival_s: float) -> Lease:
    return Lease(SimpleNamespace(), arrival_s, False)  # type: ignore[arg-type]


def test_the_router_sends_the_deadline_in_wall_clock_ms_and_drops_a_client_priority() -> None:
    body = {"model": "m", "prompt": "hi", "priority": -(10**9)}
    sent = runtime_body(body, _route(True), _lease(arrival_s=100.0),
                        wall=lambda: 5000.0, monotonic=lambda: 100.5)
    assert sent["priority"] == int((5000.0 - 0.5 + 2.0) * 1000)
    assert body["priority"] == -(10**9), "the client's body is not changed"
    assert "priority" not in runtime_body(body, _route(False), _lease(100.0))


def test_null_fields_are_left_unset_for_the_runtime() -> None:
    """`max_tokens: null` reached SGLang, which answered "Input should be a valid integer"
    twice over (#39 finding 5): null is "unset" in the OpenAI API."""
    body = {"model": "m", "prompt": "hi", "max_tokens": None, "stop": None, "n": 1}
    sent = runtime_body(body, _route(False), _lease(100.0))
    assert "max_tokens" not in sent and "stop" not in sent
    assert sent["n"] == 1 and sent["prompt"] == "hi"


def _queue() -> ModelQueue:
    return ModelQueue(_route(True), [], get_batch_policy("adaptive"), RouterSettings(),
                      RouterMetrics())


def test_an_engine_drop_becomes_the_routers_drop_answer_whole_or_streamed() -> None:
    message = f"{ENGINE_DROP_PREFIX}: its time-to-first-token deadline passed 1.00 s ago"
    whole = json.dumps({"object": "error", "message": message, "code": 429}).encode()
    streamed = f"data: {json.dumps({'error': {'message': message, 'code': 429}})}\n\n".encode()
    for content in (whole, streamed):
        response = engine_dropped(_queue(), content)
        assert response is not None and response.status_code == 429
        assert response.headers["Retry-After"] == "1"
        error = json.loads(bytes(response.body))["error"]
        assert error["type"] == "slo_drop" and "deadline passed 1.00 s ago" in error["message"]
    assert engine_dropped(_queue(), b'{"message": "queue full", "code": 429}') is None


def test_deadlines_are_read_only_from_plausible_priorities() -> None:
    now = 1_800_000_000.0
    assert deadline_from_priority(int((now + 2.5) * 1000), now) == pytest.approx(now + 2.5)
    for priority in (None, 0, -7, 1, 2**62, True, 3.5, "123"):
        assert deadline_from_priority(priority, now) is None


def test_the_work_ahead_is_added_to_every_predicted_ttft_and_named_in_the_reason() -> None:
    assert AheadPredictor(PREDICTOR, 250).ttft_s([50]) == pytest.approx(3.0)
    assert AheadPredictor(PREDICTOR, 0).ttft_s([50]) == pytest.approx(0.5)
    assert "behind 250 prompt tokens" in drop_reason(1.0, 3.0, 250)
    assert "passed 0.50 s ago" in drop_reason(-0.5, 3.0, 0)


def _req(rid: str, tokens: int, priority: int | None, output: int = 0) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=[1] * tokens, output_ids=[2] * output,
                           priority=priority, prefix_len=0)


def _scheduler(queue: list[SimpleNamespace], free: int = 3000) -> SimpleNamespace:
    aborted: list[str] = []

    def abort_request(recv_req: object) -> None:
        rid = recv_req.rid  # type: ignore[attr-defined]
        aborted.append(rid)
        scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r.rid != rid]

    scheduler = SimpleNamespace(waiting_queue=queue, chunked_req=None, max_running_requests=8,
                                forward_ct=0,
                                max_prefill_tokens=4096, tp_size=1, abort_request=abort_request,
                                aborted=aborted,
                                token_to_kv_pool_allocator=SimpleNamespace(
                                    available_size=lambda: free),
                                tree_cache=SimpleNamespace(evictable_size=lambda: 500))
    return scheduler


def test_one_step_drops_defers_and_admits_earliest_deadline_first_then_puts_back() -> None:
    """At t = 1000 s, SLO 2 s, 1 s per 100 prompt tokens: "late" cannot make it even alone
    (dropped); "near" (deadline 1001.5, 50 tokens) and "far" (1010, 200 tokens) together would
    take 2.5 s, past near's deadline, so far waits; "retracted" already produced tokens and
    stays. SGLang's admission sees only near and the retracted one; far is back after it."""
    queue = [_req("far", 200, 1_010_000), _req("late", 300, 1_001_000),
             _req("near", 50, 1_001_500), _req("retracted", 40, 999_000, output=3)]
    scheduler = _scheduler(queue)
    policy = EngineBatchPolicy(SCHEDULE, clock=lambda: 1000.0)
    seen = []

    def sglang_admission(sched: SimpleNamespace, *args: object, **kwargs: object) -> str:
        seen.append([r.rid for r in sched.waiting_queue])
        sched.waiting_queue = []  # SGLang took every request it was shown
        return "batch"

    assert policy.around(sglang_admission, scheduler, None, running_batch=None) == "batch"
    assert seen == [["retracted", "near"]]
    assert scheduler.aborted == ["late"]
    assert [r.rid for r in scheduler.waiting_queue] == ["far"]
    assert (policy.stats.dropped, policy.stats.deferred) == (1, 1)


def test_t_max_is_the_kv_the_pool_can_give_now() -> None:
    """Free 300 + evictable 500 tokens: of two requests of 500 tokens with far deadlines, the
    earlier is admitted and the other waits; with room for both, both are admitted."""
    seen: list[list[str]] = []

    def sglang_admission(sched: SimpleNamespace, *args: object, **kwargs: object) -> None:
        seen.append([r.rid for r in sched.waiting_queue])

    for free, shown in ((300, ["a"]), (3000, ["a", "b"])):
        scheduler = _scheduler([_req("b", 500, 1_100_000), _req("a", 500, 1_050_000)], free)
        EngineBatchPolicy(SCHEDULE, clock=lambda: 1000.0).around(sglang_admission, scheduler)
        assert seen.pop() == shown


def test_a_drop_sglang_would_apply_by_prefix_to_another_request_is_held_not_lost() -> None:
    """SGLang aborts by id prefix: a late request whose id prefixes another's is not aborted
    (it would take the other with it); it stays queued, and the next step decides again."""
    scheduler = _scheduler([_req("a", 300, 1_001_000), _req("ab", 10, 1_010_000)])
    seen: list[list[str]] = []
    EngineBatchPolicy(SCHEDULE, clock=lambda: 1000.0).around(
        lambda s, *a, **k: seen.append([r.rid for r in s.waiting_queue]), scheduler)
    assert scheduler.aborted == [] and seen == [["ab"]]
    assert sorted(r.rid for r in scheduler.waiting_queue) == ["a", "ab"]


def test_a_failing_decision_leaves_the_queue_to_sglang_and_never_raises() -> None:
    queue = [_req("a", 10, None)]
    scheduler = _scheduler(queue)
    scheduler.max_running_requests = "not a number"  # makes the decision raise
    policy = EngineBatchPolicy(SCHEDULE)
    shown = []
    policy.around(lambda s, *a, **k: shown.append(list(s.waiting_queue)), scheduler)
    assert shown == [queue] and policy.stats.failures == 1


def test_tp_above_one_turns_the_policy_off_rather_than_split_the_ranks() -> None:
    scheduler = _scheduler([_req("late", 300, 1_001_000)])
    scheduler.tp_size = 2
    EngineBatchPolicy(SCHEDULE, clock=lambda: 1000.0).around(lambda s, *a, **k: None, scheduler)
    assert scheduler.aborted == [] and len(scheduler.waiting_queue) == 1


def test_the_router_module_never_imports_sglang() -> None:
    """engine_dropped and runtime_body live in the router, which must stay SGLang-free."""
    code = ("import sys, fineslab.router.proxy; "
            "print(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "False"


def test_the_engine_benchmark_runs_sglang_first_and_refuses_unknown_modes() -> None:
    """SGLang's fleet drops nothing, so it calibrates the profile and measures the saturation
    rate for the others: it always runs, and first."""
    assert _modes("engine-static,sglang") == ("sglang", "engine-static")
    for bad in ("router,engine", "sglang,gpu", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _modes(bad)
    static = fleet_from_dict(fleet_config(EngineBenchConfig(), "engine-static", "x", None), "t")
    assert (static.local_scheduler, static.engine_refresh) == ("engine", False)
    engine = fleet_from_dict(fleet_config(EngineBenchConfig(), "engine", "x", None), "t")
    assert (engine.local_scheduler, engine.engine_refresh) == ("engine", True)

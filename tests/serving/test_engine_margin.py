"""The engine policy feeding a `-margin` policy's drop margin from first tokens (issue #38),
with fake SGLang scheduler and request objects (tests/serving/test_engine_deadlines.py's).

The predictor takes 1 s per 100 prompt tokens (chunks of 100), the SLO is 2 s. A teaching
request of 100 tokens is predicted at 1 s and has its first token 0.5 s after the decision
that admitted it: ratio 0.5. Once the margin has `min_samples` of them, a 300-token request
with 2 s left (predicted 3 s, 1.5x) is kept where the paper's policy aborts it, and a 600-token
one (6 s, 3x) is aborted by both.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fineslab.scheduler.local import MarginConfig, margin_of

from fineslab.sglang_plugin.config import EngineSchedule
from fineslab.sglang_plugin.engine_policy import EngineBatchPolicy
from tests.serving.test_engine_deadlines import PREDICTOR, _req, _scheduler

START_S = 1000.0


class Engine:
    """An engine policy on a fake scheduler whose SGLang admission takes every request it is
    shown into `prefilling`; the clock moves only when told."""

    def __init__(self, policy: str) -> None:
        self.now_s = START_S
        self.policy = EngineBatchPolicy(EngineSchedule.for_model(policy, 2.0, PREDICTOR,
                                                                 refresh=False),
                                        clock=lambda: self.now_s)
        self.scheduler = _scheduler([])
        self.prefilling: list[SimpleNamespace] = []

    def step(self, *queued: SimpleNamespace) -> list[str]:
        """One batch-former call with `queued` arriving; the ids SGLang was shown."""
        self.scheduler.waiting_queue.extend(queued)
        shown: list[str] = []

        def sglang_admission(sched: SimpleNamespace, *args: object, **kwargs: object) -> None:
            shown.extend(r.rid for r in sched.waiting_queue)
            self.prefilling.extend(sched.waiting_queue)
            sched.waiting_queue = []

        self.policy.around(sglang_admission, self.scheduler)
        return shown

    def first_tokens(self, after_s: float) -> None:
        """`after_s` later every request being prefilled has its first token."""
        self.now_s += after_s
        for req in self.prefilling:
            req.output_ids.append(7)
        self.prefilling.clear()

    def teach(self, count: int, ratio: float = 0.5) -> None:
        for i in range(count):
            assert self.step(_req(f"teach-{i}", 100, self.deadline_ms(10.0))) == [f"teach-{i}"]
            self.first_tokens(ratio * 1.0)  # predicted 1.0 s
        self.step()  # the hook call after the last first token

    def deadline_ms(self, in_s: float) -> int:
        return int((self.now_s + in_s) * 1000)


def test_the_paper_policy_learns_nothing_in_the_engine() -> None:
    engine = Engine("adaptive")
    assert engine.policy.margin is None
    engine.teach(3)
    assert engine.policy.stats.margin_samples == 0


def test_each_admitted_requests_first_token_is_a_sample_from_the_decision_that_admitted_it(
        ) -> None:
    engine = Engine("adaptive-margin")
    engine.teach(3)
    assert engine.policy.stats.margin_samples == 3
    margin = margin_of(engine.policy.policy)
    assert margin is not None and margin.samples == 3


def test_after_its_first_tokens_the_engine_keeps_what_the_paper_drops() -> None:
    paper, peer = Engine("adaptive-early-shed"), Engine("adaptive-early-shed-margin")
    for engine in (paper, peer):
        engine.teach(MarginConfig().min_samples)
    for engine in (paper, peer):
        engine.step(_req("x1.5", 300, engine.deadline_ms(2.0)),
                    _req("x3", 600, engine.deadline_ms(2.0)))
    assert paper.scheduler.aborted == ["x1.5", "x3"]
    assert peer.scheduler.aborted == ["x3"]
    assert [r.rid for r in peer.prefilling] == ["x1.5"], "kept and admitted, not deferred"


def test_too_few_first_tokens_leave_the_drops_the_papers() -> None:
    engine = Engine("adaptive-margin")
    engine.teach(MarginConfig().min_samples - 1)
    engine.step(_req("x1.5", 300, engine.deadline_ms(2.0)))
    assert engine.scheduler.aborted == ["x1.5"]


def test_the_drop_reason_names_the_corrected_ttft(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fineslab.sglang_plugin.engine_policy")
    engine = Engine("adaptive-margin")
    engine.teach(MarginConfig().min_samples)
    engine.step(_req("x3", 600, engine.deadline_ms(2.0)))
    assert engine.scheduler.aborted == ["x3"]
    # 6 s as profiled, x the correction learned (0.5, the oldest first tokens faded a little
    # over the 8 s they took): the TTFT the policy dropped it by.
    margin = margin_of(engine.policy.policy)
    assert margin is not None
    factor = margin.correction(engine.now_s)
    assert 0.5 <= factor < 0.6
    assert f"its first token would take about {6 * factor:.2f} s" in caplog.text, caplog.text


def test_a_request_that_waited_past_its_prediction_is_a_sample_at_once() -> None:
    """No first token yet 1.2 s after a 1 s prediction: its ratio is at least 1.2, a sample
    now (not held until its token); one still in the queue is left to the next decision."""
    engine = Engine("adaptive-margin")
    engine.step(_req("slow", 100, engine.deadline_ms(10.0)))
    engine.now_s += 0.5
    engine.step()
    assert engine.policy.stats.margin_samples == 0, "0.5 s of a 1 s prediction: wait on"
    engine.now_s += 0.7
    engine.step()
    assert engine.policy.stats.margin_samples == 1
    queued = _req("queued", 100, engine.deadline_ms(10.0))
    engine.scheduler.waiting_queue.append(queued)
    engine.policy.around(lambda s, *a, **k: None, engine.scheduler)  # admitted, not taken
    engine.now_s += 5.0
    engine.policy.around(lambda s, *a, **k: None, engine.scheduler)
    assert engine.policy.stats.margin_samples == 1, "still waiting: the decision replaces it"


def test_each_admitted_request_is_predicted_behind_the_batch_before_it() -> None:
    """Admitted together, "a" (50 tokens) first: a is predicted at 0.5 s, b (100 tokens) at
    1.5 s, the prefill of both. 0.6 s later, neither with a token: a has waited past its
    prediction (a sample), b has not."""
    engine = Engine("adaptive-margin")
    assert engine.step(_req("b", 100, engine.deadline_ms(9.0)),
                       _req("a", 50, engine.deadline_ms(8.0))) == ["a", "b"]
    engine.now_s += 0.6
    engine.step()
    assert engine.policy.stats.margin_samples == 1
    engine.now_s += 1.0
    engine.step()
    assert engine.policy.stats.margin_samples == 2


class _MovedOutputIds(SimpleNamespace):
    """A request whose `output_ids` is there for the decision, then gone (`gone`), as in an
    SGLang that moved it."""

    gone = False

    @property
    def output_ids(self) -> list[int]:
        if self.gone:
            raise AttributeError("output_ids")
        return []


def test_a_failure_feeding_the_margin_stops_the_learning_never_the_scheduler(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine("adaptive-margin")
    moved = _MovedOutputIds(rid="a", origin_input_ids=[1] * 100,
                            priority=engine.deadline_ms(10.0), prefix_len=0)
    assert engine.step(moved) == ["a"]  # type: ignore[arg-type]
    moved.gone = True
    engine.now_s += 0.5
    assert engine.step(_req("b", 10, engine.deadline_ms(10.0))) == ["b"], "the step goes on"
    assert engine.policy.margin is None and "feeding the drop margin failed" in caplog.text
    assert engine.step(_req("c", 10, engine.deadline_ms(10.0))) == ["c"]

"""Algorithm 2 where SGLang forms its prefill batches (issue #18, item 1).

Installed around `Scheduler._get_new_batch_prefill_raw` (the PluginSession's hook, or
`SchedulingSession` in a runtime with no arena) when the environment names an engine schedule
(`FINESLAB_ENGINE_POLICY`, `config.EngineSchedule`). Before SGLang's own admission runs, each
step, the local scheduler's policy (`fineslab.scheduler.local`, the one the router decides
with) decides over the waiting queue:

    deadline d_r   the `priority` field of the request when it holds a plausible deadline
                   (the router sets it: wall-clock milliseconds); otherwise the time this
                   runtime first saw it + the model's TTFT SLO
    work ahead     the prompt tokens the chunked request still has to prefill: SGLang
                   continues it first, so every TTFT the policy predicts starts after it
    N_max, T_max   request slots left (max_running_requests - running); the KV tokens the
                   pool can give now (free + evictable), at most `max_prefill_tokens`;
                   SGLang's memory checks stay in charge of what fits
    admitted       stay in the queue, earliest deadline first, for SGLang's own adder
    deferred       taken out of the queue for this step and put back after it
    dropped        aborted through SGLang's `abort_request` with HTTP 429 and the policy's
                   reason (prefixed `ENGINE_DROP_PREFIX`, which the router recognises)

Every predicted TTFT uses the schedule's profile scaled by the prefill steps this runtime has
run (`step_refresh.RefreshedPredictor`, timed around this same hook), so a profile measured
elsewhere, or a machine whose speed has changed, corrects itself while serving.

A `-margin` policy (`fineslab.scheduler.local.margin`) also learns from first tokens here: each
admitted request's predicted TTFT (the work ahead, the admitted batch before it and its own
prompt) is kept from the decision SGLang took it after, and at the hook call after its first
token (`output_ids` not empty: the step that emitted it is over) the time since that decision
is its real TTFT (the hook runs every loop iteration, idle ones too; a later call only makes
the sample look later, the safe side). One that waited past its prediction without a first
token is a sample at once (its ratio is >= 1, all the margin keeps of it), so none is held for
long; one back in the queue without a token waits for the next decision, which replaces it.

A request that already produced tokens (retracted back to the queue) is never dropped or
deferred: its first token is out. A failure inside the policy is logged and the step runs on
SGLang's own admission with the queue untouched; it never stops the scheduler. The clock is
this host's wall clock (the router's deadlines are wall-clock too: one host, or hosts in NTP).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fineslab.scheduler.local import (
    ENGINE_DROP_PREFIX,
    BatchLimits,
    QueueSnapshot,
    WaitingRequest,
    get_batch_policy,
    margin_of,
)
from fineslab.scheduler.local.margin import CorrectedPredictor
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.refreshed import PUBLISH_S, write_scales
from fineslab.sglang_plugin.config import EngineSchedule
from fineslab.sglang_plugin.step_refresh import RefreshedPredictor, StepClock

logger = logging.getLogger(__name__)

#: A `priority` further than this from now is not a deadline (a client's own priority).
PLAUSIBLE_DEADLINE_S = 86400.0
#: The policy errors logged with a traceback before the rest are counted only.
MAX_LOGGED_FAILURES = 3


@dataclass(frozen=True)
class AheadPredictor:
    """The TTFT of a batch that starts after `ahead_tokens` of prefill already under way."""

    base: ChunkedPrefillPredictor | RefreshedPredictor
    ahead_tokens: int

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.base.prefill_tokens_s(self.ahead_tokens + sum(prompt_tokens))


def deadline_from_priority(priority: object, now_s: float) -> float | None:
    """The deadline (s, wall clock) a router put in `priority` (ms), or None for anything
    else: no priority, a bool, or a number nowhere near now (a client's own priority)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        return None
    deadline_s = priority / 1000.0
    return deadline_s if abs(deadline_s - now_s) <= PLAUSIBLE_DEADLINE_S else None


def _prefilled(chunked: Any) -> int:
    """The prompt tokens of the request being prefilled in chunks that are done: up to the end
    of the chunk its last step extended (`extend_end`). SGLang moves `prefix_len` up to there
    only when it forms the next chunk, after this decision."""
    return max(chunked.prefix_len, getattr(chunked, "extend_end", None) or 0)


def drop_reason(left_s: float, ttft_s: float, ahead_tokens: int) -> str:
    """Why a request is dropped, in words a client can act on (no clock readings)."""
    behind = f" behind {ahead_tokens} prompt tokens already being prefilled" if ahead_tokens \
        else ""
    if left_s <= 0:
        return f"its time-to-first-token deadline passed {-left_s:.2f} s ago"
    return (f"its first token would take about {ttft_s:.2f} s{behind}, and its "
            f"time-to-first-token deadline is {left_s:.2f} s away")


@dataclass
class EngineStats:
    steps: int = 0
    dropped: int = 0
    deferred: int = 0
    failures: int = 0
    #: First tokens (or waits past the prediction) fed to a `-margin` policy's margin.
    margin_samples: int = 0


@dataclass(frozen=True)
class AwaitedToken:
    """A request admitted at `decided_s` (wall clock), predicted to have its first token
    `predicted_s` later: the margin's sample once it has (module doc)."""

    req: Any
    decided_s: float
    predicted_s: float


class EngineBatchPolicy:
    """The AROUND hook body: decide, then run SGLang's admission on what was admitted."""

    def __init__(self, schedule: EngineSchedule, clock: Callable[[], float] = time.time,
                 step_clock: Callable[[], float] = time.monotonic) -> None:
        self.schedule = schedule
        self.policy = get_batch_policy(schedule.policy)
        #: Scaled by the timed steps when the schedule asks for refresh; else never observes.
        self.predictor = RefreshedPredictor(schedule.predictor(), clock=clock)
        self.steps: StepClock | None = StepClock(self.predictor) if schedule.refresh else None
        self.clock = clock
        self.step_clock = step_clock
        self.stats = EngineStats()
        #: When this runtime first saw each waiting request without a deadline (by id()).
        self._first_seen: dict[int, float] = {}
        self._tp_refused = False
        self._published_s, self._published_samples = -math.inf, 0
        self._aged_s = -math.inf
        #: The margin a `-margin` policy learns with (None: none, or its feeding failed), and
        #: the admitted requests whose first token it waits for (by id()).
        self.margin = margin_of(self.policy)
        self._awaited: dict[int, AwaitedToken] = {}

    def around(self, original: Callable[..., Any], scheduler: Any, *args: Any,
               **kwargs: Any) -> Any:
        running_batch = kwargs.get("running_batch", args[1] if len(args) > 1 else None)
        self._time_step(scheduler, formed=False)
        self._note_first_tokens(scheduler)
        held = self._before(scheduler, running_batch)
        try:
            result = original(scheduler, *args, **kwargs)
        finally:
            if held:
                scheduler.waiting_queue.extend(held)
        # (new batch or None, running batch): time the prefill it formed, if any
        self._time_step(scheduler, formed=True, result=result)
        return result

    def _time_step(self, scheduler: Any, formed: bool, result: Any = None) -> None:
        """Feed the step clock: before the batch former runs, the last step has ended; after
        it (`formed`, its `result`), a prefill may have been formed. A failure here turns the
        refresh off (the profile as given goes on deciding); it never stops the scheduler."""
        if self.steps is None:
            return
        try:
            if not formed:
                now_s = self.step_clock()
                self.steps.loop_came_back(scheduler.forward_ct, now_s)
                if now_s - self._aged_s >= PUBLISH_S:  # scales no step refreshes fade
                    self.predictor.age()
                    self._aged_s = now_s
                self._publish(now_s)
            else:
                batch = result[0] if isinstance(result, tuple) else result
                self.steps.batch_formed(batch, scheduler.forward_ct, self.step_clock())
        except Exception:
            self.steps = None
            logger.exception("fineslab engine scheduler: timing prefill steps failed; the "
                             "profile is used as given from now on")

    def _publish(self, now_s: float) -> None:
        """Write the scales for the router's gate, at most every PUBLISH_S and only once a
        step was timed. A failed write is logged once and publishing stops (the router's gate
        goes on with what it last read); the scheduler never stops for it."""
        path = self.schedule.publish
        samples = self.predictor.overall.samples
        if path is None or samples == self._published_samples \
                or now_s - self._published_s < PUBLISH_S:
            return
        try:
            write_scales(Path(path), self.predictor)
        except OSError:
            self.schedule = dataclasses.replace(self.schedule, publish=None)
            logger.exception("fineslab engine scheduler: cannot write the step scales to %s; "
                             "the router's gate keeps the scales it last read", path)
            return
        self._published_s, self._published_samples = now_s, samples

    def _note_first_tokens(self, scheduler: Any) -> None:
        """Feed the margin the admitted requests that have their first token now, or waited
        past their prediction without one (module doc); a request still waiting is left to
        the next decision. A failure turns the learning off (the margin fades back to the
        policy it wraps); it never stops the scheduler."""
        if self.margin is None or not self._awaited:
            return
        try:
            now_s = self.clock()
            waiting = {id(req) for req in scheduler.waiting_queue}
            for key, awaited in list(self._awaited.items()):
                waited_s = now_s - awaited.decided_s
                if len(awaited.req.output_ids) == 0 and (key in waiting
                                                         or waited_s < awaited.predicted_s):
                    continue
                del self._awaited[key]
                if self.margin.observe(awaited.predicted_s, waited_s, now_s):
                    self.stats.margin_samples += 1
        except Exception:
            self.margin, self._awaited = None, {}
            logger.exception("fineslab engine scheduler: feeding the drop margin failed; it "
                             "fades back to the policy's own drops")

    def _await_first_tokens(self, fresh: list[Any], admitted: list[Any],
                            requests: list[WaitingRequest], predictor: AheadPredictor,
                            now_s: float) -> None:
        """Keep each admitted request's predicted TTFT, from this decision, for the margin: the
        prefill ahead of it and of the admitted batch up to it; a fresh request's earlier
        prediction is void (SGLang did not take it then)."""
        for req in fresh:
            self._awaited.pop(id(req), None)
        tokens = 0
        for req, request in zip(admitted, requests, strict=True):
            tokens += request.prompt_tokens
            self._awaited[id(req)] = AwaitedToken(req, now_s, predictor.ttft_s([tokens]))

    def _before(self, scheduler: Any, running_batch: Any) -> list[Any]:
        """Apply one decision to the waiting queue; the deferred requests to put back."""
        if not scheduler.waiting_queue:
            self._first_seen.clear()
            return []
        if scheduler.tp_size > 1:
            # Each rank would read its own clock and could drop different requests; SGLang needs
            # every rank to make the same step. The launcher refuses this; a hand-made one logs.
            if not self._tp_refused:
                self._tp_refused = True
                logger.error("fineslab engine scheduler: off in a runtime with tp_size %d > 1; "
                             "SGLang's own admission runs", scheduler.tp_size)
            return []
        try:
            return self._decide(scheduler, running_batch)
        except Exception:  # never stop SGLang's scheduler: fall back to its own admission
            self.stats.failures += 1
            if self.stats.failures <= MAX_LOGGED_FAILURES:
                logger.exception("fineslab engine scheduler: a decision failed; this step "
                                 "runs on SGLang's own admission")
            return []

    def _deadline(self, req: Any, now_s: float) -> float:
        deadline = deadline_from_priority(req.priority, now_s)
        if deadline is None:
            deadline = self._first_seen.setdefault(id(req), now_s) + self.schedule.ttft_slo_s
        return deadline

    def _decide(self, scheduler: Any, running_batch: Any) -> list[Any]:
        self.stats.steps += 1
        now_s = self.clock()
        queue = list(scheduler.waiting_queue)
        started = [req for req in queue if len(req.output_ids) > 0]
        fresh = [req for req in queue if len(req.output_ids) == 0]
        if not fresh:
            return []
        slo_s = self.schedule.ttft_slo_s
        by_id = {str(i): req for i, req in enumerate(fresh)}
        waiting = tuple(WaitingRequest(key, self._deadline(req, now_s) - slo_s,
                                       len(req.origin_input_ids))
                        for key, req in by_id.items())
        running = len(running_batch.reqs) if running_batch is not None else 0
        room = (scheduler.token_to_kv_pool_allocator.available_size()
                + scheduler.tree_cache.evictable_size())
        limits = BatchLimits(max(1, scheduler.max_running_requests - running),
                             max(1, min(scheduler.max_prefill_tokens, room)))
        chunked = scheduler.chunked_req
        ahead = 0 if chunked is None else max(0, len(chunked.origin_input_ids)
                                              - _prefilled(chunked))
        predictor = AheadPredictor(self.predictor, ahead)
        decision = self.policy.decide(QueueSnapshot(waiting, now_s, slo_s, limits), predictor)
        dropped = [(by_id[d.request.request_id], d.request) for d in decision.dropped]
        admitted = [by_id[r.request_id] for r in decision.admitted]
        deferred = [by_id[r.request_id] for r in decision.deferred]
        if self.margin is not None:
            self._await_first_tokens(fresh, admitted, list(decision.admitted), predictor, now_s)
        # The TTFT a drop's reason names is the one the policy decided with.
        learned = margin_of(self.policy)
        said = predictor if learned is None else CorrectedPredictor(
            predictor, learned.correction(now_s))
        for req, request in dropped:
            self._drop(scheduler, req, drop_reason(
                request.deadline_s(slo_s) - now_s, said.ttft_s([request.prompt_tokens]),
                ahead))
        # Whatever is still queued and not admitted is held for this step (the deferred, and a
        # drop `_drop` left alone): no request leaves the queue but by SGLang's own abort.
        live = {id(req) for req in scheduler.waiting_queue}
        kept = started + [req for req in admitted if id(req) in live]
        kept_ids = {id(req) for req in kept}
        held = [req for req in [*deferred, *(req for req, _ in dropped)]
                if id(req) in live and id(req) not in kept_ids]
        scheduler.waiting_queue = kept
        self.stats.deferred += len(deferred)
        current = {id(req) for req in queue} - {id(req) for req, _ in dropped}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in current}
        return held

    def _drop(self, scheduler: Any, req: Any, reason: str) -> None:
        """Abort one waiting request through SGLang's own path (its output goes back as a 429),
        unless its id is a prefix of another's (SGLang aborts by prefix): then leave it."""
        from sglang.srt.managers.io_struct import AbortReq

        rid = req.rid
        others = [*scheduler.waiting_queue, *([scheduler.chunked_req]
                                              if scheduler.chunked_req is not None else [])]
        if any(other is not req and str(other.rid).startswith(rid) for other in others):
            return
        message = f"{ENGINE_DROP_PREFIX}: {reason}"
        scheduler.abort_request(AbortReq(rid=rid, finished_reason={
            "type": "abort", "message": message,
            "status_code": HTTPStatus.TOO_MANY_REQUESTS, "err_type": None}))
        self.stats.dropped += 1
        logger.info("fineslab engine scheduler: dropped request %s (%d prompt tokens): %s",
                    rid, len(req.origin_input_ids), reason)


class SchedulingSession:
    """The engine policy alone, for a runtime that keeps SGLang's own KV pool (no arena)."""

    def __init__(self, engine: EngineBatchPolicy) -> None:
        self.engine = engine

    def new_batch_prefill(self, original: Callable[..., Any], scheduler: Any, *args: Any,
                          **kwargs: Any) -> Any:
        return self.engine.around(original, scheduler, *args, **kwargs)

"""Per-model queues released to the runtimes by the local scheduler (paper Algorithm 2).

A request waits in its model's queue as a `Ticket` until the queue's dispatcher decides. Each
round (on an arrival, a completion, a replica change, or every `tick_s`) the dispatcher:

    1. reads live state: free request slots  N_max = sum over up replicas of
       (max_running - inflight), and KV room  T_max = min(max_batched_tokens, KV free tokens of
       the emptiest replica, from the slab table);
    2. asks the batch policy for a decision on a `QueueSnapshot` (arrival times on the router's
       monotonic clock, the model's TTFT SLO, the chunked-prefill TTFT predictor, and a
       forecast of when each slot frees: leased time + the mean slot hold measured here, an
       EWMA; `adaptive-early-shed` drops with it what will not get a slot in time);
    3. admitted: hands each ticket the least-loaded up replica (a lease, inflight += 1);
       dropped: rejects the ticket with the policy's reason (-> 429/503 + Retry-After), or with
       `on_drop: best_effort` moves it to a FIFO served from the slots left after admission;
       deferred: stays.

A `-margin` policy (`fineslab.scheduler.local.margin`) learns here too: each lease carries the
TTFT the queue's predictor gave it at the round that admitted it (the admitted batch up to it),
and its first streamed token (`first_token`, from the proxy) is the sample, real TTFT from the
lease. A lease released without one (not streamed, dropped by the engine, failed) counts as a
first token at its prediction or later (ratio >= 1): what it says of the predictor is unknown,
and the margin then only stays nearer the paper's drops.

With no free slot the policy still runs with N_max = 1 so that requests that can no longer meet
their deadline are dropped on time, but nothing is admitted. That holds with no runtime up too: a
request then waits for a restart until its deadline, and is rejected as `NoLiveRuntime` (503)
even under `on_drop: best_effort`, which would otherwise wait for a runtime that may not return.
Invariant, per model:

    sum(replica.inflight) == leases handed out - leases released
    every ticket ends exactly once: leased, rejected, or cancelled by its client
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fineslab.errors import TransientError
from fineslab.router.metrics import RouterMetrics
from fineslab.router.replicas import Replica
from fineslab.router.routes import ModelRoute, RouterSettings
from fineslab.scheduler.local import (
    BatchLimits,
    BatchPolicy,
    QueueSnapshot,
    TtftPredictor,
    WaitingRequest,
    margin_of,
)

logger = logging.getLogger(__name__)

#: Weight of the newest slot hold in the mean service time, and how many requests are served
#: before the queue forecasts slots (the early-shed policy reads the forecast).
SERVICE_EWMA = 0.2
MIN_SERVED = 3


class RequestDropped(TransientError):
    """The local scheduler dropped the request: it cannot meet its TTFT deadline."""


class NoLiveRuntime(RequestDropped):
    """Dropped while none of the model's runtimes was up (HTTP 503, whatever `on_drop` says)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Ticket:
    request: WaitingRequest
    future: asyncio.Future[Replica]
    best_effort: bool = False
    leased_s: float = 0.0
    predicted_ttft_s: float | None = None


@dataclass
class Lease:
    """A request's claim on one replica's slot; give it back with `ModelQueue.release`."""

    replica: Replica
    arrival_s: float
    best_effort: bool
    #: The request's id in its queue, and when the scheduler handed it the slot.
    request_id: str = ""
    leased_s: float = 0.0
    released: bool = field(default=False)
    #: The TTFT predicted when it was leased, until a `-margin` policy's margin has its sample.
    predicted_ttft_s: float | None = None


class ModelQueue:
    def __init__(self, route: ModelRoute, replicas: list[Replica], policy: BatchPolicy,
                 settings: RouterSettings, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.route, self.replicas, self.policy = route, replicas, policy
        self.settings, self.metrics, self.clock = settings, metrics, clock
        self._waiting: dict[str, Ticket] = {}
        self._best_effort: deque[Ticket] = deque()
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        #: When each slot held now was handed out (request id -> leased_s), and the mean time
        #: a request holds its slot (EWMA over released leases; None until MIN_SERVED).
        self._held: dict[str, float] = {}
        self._served = 0
        self.mean_service_s: float | None = None
        self.margin = margin_of(policy)

    def __len__(self) -> int:
        return len(self._waiting) + len(self._best_effort)

    def wake(self) -> None:
        self._wake.set()

    def _back_in_s(self) -> int | None:
        """Seconds until the first replica of a model with none up is expected back."""
        etas = [r.retry_after_s() for r in self.replicas]
        known = [eta for eta in etas if eta is not None]
        return min(known) if known and len(known) == len(etas) else None

    def can_take_soon(self) -> bool:
        """Whether a replica is up, or expected back within the TTFT SLO."""
        if any(r.up for r in self.replicas):
            return True
        back_in_s = self._back_in_s()
        return back_in_s is not None and back_in_s <= self.route.ttft_slo_s

    async def acquire(self, prompt_tokens: int) -> Lease:
        """Wait until the scheduler releases this request; raises RequestDropped."""
        now_s = self.clock()
        back_in_s = None if any(r.up for r in self.replicas) else self._back_in_s()
        if back_in_s is not None and back_in_s > self.route.ttft_slo_s:
            # Waiting for the restart cannot meet the deadline: say so now, not at it.
            raise NoLiveRuntime(
                f"model {self.route.name} is restarting and expected back in about "
                f"{back_in_s} s, past this request's {self.route.ttft_slo_s:g} s time to "
                "first token", back_in_s)
        request = WaitingRequest(f"{self.route.name}-{next(self._ids)}", now_s, prompt_tokens)
        ticket = Ticket(request, asyncio.get_running_loop().create_future())
        self._waiting[request.request_id] = ticket
        self.wake()
        try:
            replica = await ticket.future
        except asyncio.CancelledError:
            future = ticket.future
            if future.done() and not future.cancelled() and future.exception() is None:
                # Leased in the instant its client left: give the slot back.
                self.release(self._lease_of(ticket, future.result()), served=False)
            raise
        finally:
            self._waiting.pop(request.request_id, None)
        return self._lease_of(ticket, replica)

    @staticmethod
    def _lease_of(ticket: Ticket, replica: Replica) -> Lease:
        return Lease(replica, ticket.request.arrival_s, ticket.best_effort,
                     ticket.request.request_id, ticket.leased_s,
                     predicted_ttft_s=ticket.predicted_ttft_s)

    def first_token(self, lease: Lease, first_s: float) -> None:
        """The leased request's first token was streamed at `first_s` (this queue's clock):
        the margin's sample, its real TTFT counted from the lease (module doc)."""
        if self.margin is not None and lease.predicted_ttft_s is not None:
            self.margin.observe(lease.predicted_ttft_s, first_s - lease.leased_s, first_s)
        lease.predicted_ttft_s = None

    def release(self, lease: Lease, served: bool = True) -> None:
        if not lease.released:
            lease.released = True
            lease.replica.inflight -= 1
            self._held.pop(lease.request_id, None)
            now_s = self.clock()
            if served:
                self._note_service(now_s - lease.leased_s)
            if lease.predicted_ttft_s is not None:  # no first token seen: ratio >= 1
                self.first_token(lease, max(now_s, lease.leased_s + lease.predicted_ttft_s))
            self.wake()

    def _note_service(self, held_s: float) -> None:
        """One more measured slot hold: the mean the early shed forecasts with."""
        self._served += 1
        if self.mean_service_s is None:
            self.mean_service_s = held_s
        else:
            self.mean_service_s += SERVICE_EWMA * (held_s - self.mean_service_s)

    def slot_forecast(self, free_slots: int, now_s: float) -> tuple[float, ...]:
        """Seconds until each slot of the up replicas frees (0 for each of the `free_slots`),
        ascending; empty until MIN_SERVED requests were served (no estimate to make)."""
        mean_s = self.mean_service_s
        if mean_s is None or self._served < MIN_SERVED:
            return ()
        busy = [max(0.0, leased_s + mean_s - now_s) for leased_s in self._held.values()]
        return tuple(sorted([0.0] * free_slots + busy))

    async def run(self) -> None:
        """The dispatcher loop; runs until cancelled."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.tick_s)
            self._wake.clear()
            try:
                self.dispatch_once()
            except Exception:  # a bug here must not stop the model's queue for good
                logger.exception("dispatcher of %s failed a round", self.route.name)

    # -- one round ------------------------------------------------------------------------------

    def dispatch_once(self) -> None:
        live = [t for t in self._waiting.values() if not t.future.done() and not t.best_effort]
        up = [r for r in self.replicas if r.up]
        free_slots = sum(max(0, self.route.max_running_requests - r.inflight) for r in up)
        if live:
            self._decide(live, up, free_slots)
        self._serve_best_effort()

    def _limits(self, up: list[Replica], free_slots: int) -> BatchLimits:
        max_tokens = self.route.max_batched_tokens
        if self.route.kv_free_tokens is not None:
            known = [self.route.kv_free_tokens(r.runtime_id) for r in up]
            kv = [k for k in known if k is not None]
            if kv:
                max_tokens = min(max_tokens, max(kv))
        return BatchLimits(max(1, free_slots), max(1, max_tokens))

    def _decide(self, live: list[Ticket], up: list[Replica], free_slots: int) -> None:
        now_s = self.clock()
        snapshot = QueueSnapshot(tuple(t.request for t in live), now_s,
                                 self.route.ttft_slo_s, self._limits(up, free_slots),
                                 self.slot_forecast(free_slots, now_s) if up else (),
                                 self.mean_service_s or 0.0)
        decision = self.policy.decide(snapshot, self.route.predictor)
        by_id = {t.request.request_id: t for t in live}
        if free_slots > 0:
            predicted = self._predicted(decision.admitted, self.route.predictor)
            for request in decision.admitted:
                self._lease(by_id[request.request_id], up, predicted.get(request.request_id))
        for dropped in decision.dropped:
            ticket = by_id[dropped.request.request_id]
            if not up:
                ticket.future.set_exception(NoLiveRuntime(
                    f"model {self.route.name} has no runtime up (restarting) and this request "
                    f"waited its {self.route.ttft_slo_s:g} s time to first token for one",
                    self._back_in_s()))
                self.metrics.dropped(self.route.name, "rejected")
            elif self.settings.on_drop == "best_effort":
                ticket.best_effort = True
                self._best_effort.append(ticket)
                self.metrics.dropped(self.route.name, "best_effort")
            else:
                ticket.future.set_exception(RequestDropped(
                    f"model {self.route.name} is overloaded: this request cannot get its first "
                    f"token within its {self.route.ttft_slo_s:g} s target; retry later "
                    f"(scheduler: {dropped.reason})"))
                self.metrics.dropped(self.route.name, "rejected")

    def _predicted(self, admitted: tuple[WaitingRequest, ...],
                   predictor: TtftPredictor) -> dict[str, float]:
        """For a margin to learn from (module doc): each admitted request's predicted TTFT,
        the prefill of the admitted batch up to it; empty when the policy learns nothing."""
        if self.margin is None:
            return {}
        predicted, tokens = {}, 0
        for request in admitted:
            tokens += request.prompt_tokens
            predicted[request.request_id] = predictor.ttft_s([tokens])
        return predicted

    def _lease(self, ticket: Ticket, up: list[Replica],
               predicted_ttft_s: float | None = None) -> bool:
        candidates = [r for r in up if r.up and r.inflight < self.route.max_running_requests]
        if not candidates or ticket.future.done():
            return False
        replica = min(candidates, key=lambda r: r.inflight)
        replica.inflight += 1
        ticket.leased_s = self.clock()
        ticket.predicted_ttft_s = predicted_ttft_s
        self._held[ticket.request.request_id] = ticket.leased_s
        ticket.future.set_result(replica)
        self.metrics.admitted(self.route.name, ticket.best_effort)
        return True

    def _serve_best_effort(self) -> None:
        while self._best_effort:
            ticket = self._best_effort[0]
            if ticket.future.done():
                self._best_effort.popleft()
                continue
            if not self._lease(ticket, [r for r in self.replicas if r.up]):
                return
            self._best_effort.popleft()

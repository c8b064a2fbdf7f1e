"""The local scheduler's contract: a snapshot of one model's queue in, a frozen decision out.

A `BatchPolicy` decides which waiting requests of one model to prefill next. It is fed a
`QueueSnapshot` (the waiting requests, the time `now_s` given by the caller, the model's TTFT SLO
and the caps N_max / T_max) and a TTFT predictor, and returns a `BatchDecision`: every waiting
request appears exactly once, as admitted, dropped (with a reason) or deferred. The policy acts
on nothing: the router or the simulator applies the decision, so both can drive it with their
own clocks.

    admitted + dropped + deferred == waiting          (as sets of request ids)
    sum(prompt_tokens of admitted) <= T_max  unless a single request (chunked prefill splits it)
    len(admitted) <= N_max
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fineslab.errors import ConfigError

#: The message of every drop made inside a runtime by the engine policy
#: (`fineslab.sglang_plugin.engine_policy`) starts with this; the router answers such a runtime
#: 429 as its own drop.
ENGINE_DROP_PREFIX = "fineslab scheduler: dropped before prefill"


@dataclass(frozen=True)
class WaitingRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int

    def deadline_s(self, ttft_slo_s: float) -> float:
        """Algorithm 2, line 4: d_r = arrival(r) + slo."""
        return self.arrival_s + ttft_slo_s


@dataclass(frozen=True)
class BatchLimits:
    """Per-model caps from the current free compute and memory (N_max, T_max)."""

    max_requests: int
    max_batched_tokens: int

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_batched_tokens < 1:
            raise ConfigError(f"batch limits must be >= 1, got {self}")


@dataclass(frozen=True)
class QueueSnapshot:
    requests: tuple[WaitingRequest, ...]
    now_s: float
    ttft_slo_s: float
    limits: BatchLimits
    #: Seconds until each busy request slot is expected to free, ascending, from the caller's
    #: measured service times; empty when it has none (Algorithm 2 does not read it).
    slot_free_in_s: tuple[float, ...] = ()
    #: The caller's mean seconds a request holds its slot (0 when unknown).
    mean_service_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0:
            raise ConfigError(f"ttft_slo_s must be positive, got {self.ttft_slo_s}")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ConfigError("request ids in a queue snapshot must be unique")


@dataclass(frozen=True)
class DroppedRequest:
    request: WaitingRequest
    reason: str


@dataclass(frozen=True)
class BatchDecision:
    """What to do with each waiting request; `admitted` is in serving order."""

    admitted: tuple[WaitingRequest, ...]
    dropped: tuple[DroppedRequest, ...]
    deferred: tuple[WaitingRequest, ...]
    #: now_s + TTFT(admitted) as the predictor saw it; None when nothing is admitted.
    predicted_finish_s: float | None


class TtftPredictor(Protocol):
    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        """Seconds until every prompt of the batch is prefilled (monotone in the batch)."""
        ...


class BatchPolicy(Protocol):
    name: str

    def decide(self, snapshot: QueueSnapshot, predictor: TtftPredictor) -> BatchDecision:
        ...


def trim(ordered: Sequence[WaitingRequest], limits: BatchLimits) -> list[WaitingRequest]:
    """The longest prefix within N_max requests and T_max batched prompt tokens.

    The head is always kept, even when its prompt alone exceeds T_max: chunked prefill splits a
    long prompt over steps, and refusing it would starve the queue behind it.
    """
    kept: list[WaitingRequest] = []
    total_tokens = 0
    for request in ordered:
        if len(kept) == limits.max_requests:
            break
        if kept and total_tokens + request.prompt_tokens > limits.max_batched_tokens:
            break
        kept.append(request)
        total_tokens += request.prompt_tokens
    return kept


def finish_decision(snapshot: QueueSnapshot, predictor: TtftPredictor,
                    admitted: Sequence[WaitingRequest],
                    dropped: Sequence[DroppedRequest]) -> BatchDecision:
    """Everything neither admitted nor dropped is deferred (kept in arrival order)."""
    taken = {r.request_id for r in admitted} | {d.request.request_id for d in dropped}
    deferred = tuple(r for r in snapshot.requests if r.request_id not in taken)
    finish_s = (snapshot.now_s + predictor.ttft_s(r.prompt_tokens for r in admitted)
                if admitted else None)
    return BatchDecision(tuple(admitted), tuple(dropped), deferred, finish_s)

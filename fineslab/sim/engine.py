"""One simulated model replica: an SGLang-like engine loop over profiled step latencies.

Each replica runs one step at a time, like an SGLang scheduler process:

    1 admit    when no prefill is in flight, the local scheduler (the real `BatchPolicy`) is
               given a snapshot of the waiting queue; dropped requests leave at once, admitted
               ones get KV blocks from the real slab allocator for prompt + output tokens (a
               request whose blocks are not there stays waiting, and so does the rest of the
               batch behind it)
    2 step     prefill has priority (SGLang's default, no mixed chunks): a prefill step takes up
               to `chunk_tokens` tokens from the admitted prompts, in order, and lasts
               profile.prefill_s(tokens); otherwise one decode step over every running request
               lasts profile.decode.step_s(batch, mean context)
    3 finish   at the end of a step its effects land: a prompt fully prefilled emits its first
               token (TTFT), a decode step emits one token per running request, a request with
               all its output tokens frees its blocks (or, with `SimConfig.prefix_cache`, leaves
               them to the replica's cache, which its own allocations evict oldest first)

The step duration is multiplied by the co-location factor the simulator passes in (see
`SimConfig.interference_per_neighbor`). The policy is consulted at every step boundary unless
its inputs (the queue, the replica's room) are unchanged since a decision that admitted and
dropped nothing: for FCFS, Moore-Hodgson and Algorithm 2 such a decision cannot change with
time alone (FCFS ignores time, Moore-Hodgson only finds more requests late, Algorithm 2 admits
or drops something whenever its queue is non-empty), so skipping it changes no outcome and
saves the O(n log n) re-sort per decode step. Work conservation: when the policy admits
nothing and the replica has nothing else to do, the oldest deferred request is admitted anyway
(Prism serves late requests after the on-time ones; without this a Moore-Hodgson queue of late
requests would wait forever on an idle GPU).

A step also pays the page map/unmap time it owes (kvcached's KV mode only, `sim.pages`),
added after the co-location factor: it is driver work, which co-located kernels do not slow.

    waiting + prefilling + decoding + finished + dropped == requests routed here   (always)
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from fineslab.loadgen.metrics import RequestOutcome
from fineslab.scheduler.local import BatchLimits, BatchPolicy, QueueSnapshot, WaitingRequest
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.sim.config import SimConfig
from fineslab.sim.kv import ReplicaKv
from fineslab.workload import Request

logger = logging.getLogger(__name__)


@dataclass
class Running:
    """A request admitted to a replica (mutable while it runs)."""

    request: Request
    blocks: list[list[int]]
    prefill_left_tokens: int
    generated_tokens: int = 0
    first_token_s: float | None = None


@dataclass(frozen=True)
class Step:
    """A step in flight: what it works on and how long it takes alone."""

    kind: str  # "prefill" | "decode"
    alone_s: float
    prefill_tokens: tuple[tuple[Running, int], ...] = ()
    #: Synchronous page map/unmap time on this step's path (0 unless KV is kvcached's pages).
    map_s: float = 0.0


class MemoTtftPredictor:
    """The chunked-prefill TTFT predictor with its answers memoized by total prompt tokens.

    The policies call TTFT once per waiting request per decision (Moore-Hodgson) and a replica
    decides at every step, so the same few thousand totals are asked millions of times; the
    answer depends on the total only (`ChunkedPrefillPredictor.ttft_s`).
    """

    def __init__(self, predictor: ChunkedPrefillPredictor) -> None:
        self.predictor = predictor
        self._by_total: dict[int, float] = {}

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        total = sum(prompt_tokens)
        seconds = self._by_total.get(total)
        if seconds is None:
            seconds = self._by_total[total] = self.predictor.prefill_tokens_s(total)
        return seconds


@dataclass
class ReplicaEngine:
    key: str
    model: str
    profile: ModelProfile
    gpu_ids: tuple[int, ...]
    policy: BatchPolicy
    ttft_slo_s: float
    kv: ReplicaKv
    config: SimConfig
    waiting: OrderedDict[str, Request] = field(default_factory=OrderedDict)
    prefilling: list[Running] = field(default_factory=list)
    decoding: list[Running] = field(default_factory=list)
    outcomes: list[RequestOutcome] = field(default_factory=list)
    step: Step | None = None
    tokens_emitted: int = 0
    #: Bumped when the policy's inputs change (an arrival, a request leaving the replica).
    inputs_version: int = 0
    #: The inputs_version of the last decision that admitted and dropped nothing, if any.
    idle_version: int | None = None
    #: Finished requests' blocks kept as the prefix cache, oldest first (SimConfig.prefix_cache).
    cached: deque[list[list[int]]] = field(default_factory=deque)
    #: The blocks the last admission lacked (0: it was not short), for the cache squeeze.
    short_blocks: int = 0

    def __post_init__(self) -> None:
        self.predictor = MemoTtftPredictor(ChunkedPrefillPredictor.from_profile(self.profile))

    @property
    def busy(self) -> bool:
        return self.step is not None

    def _evict_oldest(self) -> None:
        """Give the oldest cached request's blocks back."""
        self.kv.free(self.cached.popleft())

    def flush_cache(self) -> int:
        """Give every cached block back (SGLang's `/flush_cache`); the requests' count."""
        flushed = len(self.cached)
        while self.cached:
            self._evict_oldest()
        return flushed

    def give_cache_for(self, asker: ReplicaEngine) -> int:
        """The cache squeeze (`SimConfig.cache_squeeze`): give back this replica's oldest
        cached requests until `asker` has the blocks its admission lacked; the count given."""
        given = 0
        while self.cached and asker.kv.available_blocks() < asker.short_blocks:
            self._evict_oldest()
            given += 1
        return given

    def _alloc(self, num_blocks: int) -> list[list[int]] | None:
        """Blocks for a request, evicting this replica's own cache (oldest first) as SGLang
        evicts its radix cache for its own requests; None when still short."""
        blocks = self.kv.try_alloc(num_blocks)
        while blocks is None and self.cached:
            self._evict_oldest()
            blocks = self.kv.try_alloc(num_blocks)
        return blocks

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def enqueue(self, request: Request) -> None:
        self.waiting[request.request_id] = request
        self.inputs_version += 1

    # -- 1 admit --------------------------------------------------------------------------------
    def _admit(self, now_s: float) -> None:
        room = self.config.max_running_requests - len(self.prefilling) - len(self.decoding)
        if not self.waiting or room < 1 or self.idle_version == self.inputs_version:
            return
        window = [WaitingRequest(r.request_id, r.arrival_s, r.prompt_tokens)
                  for r in list(self.waiting.values())[: self.config.max_snapshot_requests]]
        snapshot = QueueSnapshot(tuple(window), now_s, self.ttft_slo_s,
                                 BatchLimits(room, self.config.max_prefill_tokens))
        decision = self.policy.decide(snapshot, self.predictor)
        for dropped in decision.dropped:
            self._drop(self.waiting.pop(dropped.request.request_id), "deadline")
        admitted = [w.request_id for w in decision.admitted]
        if not admitted and not self.prefilling and not self.decoding and decision.deferred:
            admitted = [decision.deferred[0].request_id]
        if not admitted and not decision.dropped:
            self.idle_version = self.inputs_version
        for request_id in admitted:
            if not self._start(self.waiting[request_id]):
                break

    def _start(self, request: Request) -> bool:
        """Reserve KV for the whole request and move it to prefill; False (nothing held, the
        request still waiting) when blocks are short. A request that can never fit is dropped."""
        num_blocks = self.kv.blocks_for(request.prompt_tokens + request.output_tokens)
        if num_blocks > self.kv.capacity_blocks:
            del self.waiting[request.request_id]
            self._drop(request, "larger than this replica's KV space")
            return True
        blocks = self._alloc(num_blocks)
        if blocks is None:
            self.short_blocks = num_blocks
            return False
        self.short_blocks = 0
        del self.waiting[request.request_id]
        self.prefilling.append(Running(request, blocks, request.prompt_tokens))
        return True

    def _drop(self, request: Request, reason: str) -> None:
        self.outcomes.append(RequestOutcome(
            request.request_id, request.model, request.arrival_s, request.prompt_tokens, 0,
            None, None, dropped=reason, ttft_slo_s=self.ttft_slo_s))

    # -- 2 step ---------------------------------------------------------------------------------
    def plan_step(self, now_s: float) -> Step | None:
        """Admit, then pick the next step (None: nothing to do). Does not start it."""
        if not self.prefilling:
            self._admit(now_s)
        if self.prefilling:
            budget = self.profile.chunk_tokens
            taken: list[tuple[Running, int]] = []
            for running in self.prefilling:
                if budget == 0:
                    break
                tokens = min(budget, running.prefill_left_tokens)
                taken.append((running, tokens))
                budget -= tokens
            num_tokens = self.profile.chunk_tokens - budget
            return Step("prefill", self.profile.prefill_s(num_tokens), tuple(taken),
                        self.kv.settle_step())
        if self.decoding:
            context = sum(r.request.prompt_tokens + r.generated_tokens
                          for r in self.decoding) / len(self.decoding)
            return Step("decode", self.profile.decode.step_s(len(self.decoding), context),
                        map_s=self.kv.settle_step())
        return None

    # -- 3 finish -------------------------------------------------------------------------------
    def finish_step(self, now_s: float) -> bool:
        """Apply the step in flight at `now_s`; True when KV blocks were freed (with the
        prefix cache they are kept: False)."""
        step, self.step = self.step, None
        assert step is not None, "finish_step without a step in flight"
        if step.kind == "prefill":
            for running, tokens in step.prefill_tokens:
                running.prefill_left_tokens -= tokens
            done = [r for r in self.prefilling if r.prefill_left_tokens == 0]
            self.prefilling = [r for r in self.prefilling if r.prefill_left_tokens > 0]
            for running in done:
                running.first_token_s = now_s
                self.decoding.append(running)
            emitted = done
        else:
            emitted = self.decoding
        for running in emitted:
            running.generated_tokens += 1
        self.tokens_emitted += len(emitted)
        finished = [r for r in self.decoding
                    if r.generated_tokens >= r.request.output_tokens]
        if finished:
            self.inputs_version += 1
            self.decoding = [r for r in self.decoding
                             if r.generated_tokens < r.request.output_tokens]
            for running in finished:
                self._finish(running, now_s)
        return bool(finished) and not self.config.prefix_cache

    def _finish(self, running: Running, now_s: float) -> None:
        if self.config.prefix_cache:
            self.cached.append(running.blocks)
        else:
            self.kv.free(running.blocks)
        request = running.request
        assert running.first_token_s is not None
        self.outcomes.append(RequestOutcome(
            request.request_id, request.model, request.arrival_s, request.prompt_tokens,
            running.generated_tokens, running.first_token_s - request.arrival_s,
            now_s - request.arrival_s, ttft_slo_s=self.ttft_slo_s))

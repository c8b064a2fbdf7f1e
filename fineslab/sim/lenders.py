"""SwiftCache (paper 003): the step clock every model runs on, and the lenders' side.

The master (`prefix.py`) and each lender run one engine: a `ChunkedServer` on its own step
clock, driven by `run_server`, asking a `Memory` whether a job fits. A lender's memory is its
own KV (`WorkerMemory`); its demand over time gives, by Algorithm 1 (`elastic_offers`, with
`scale_up`/`scale_down` from the live policy `fineslab.scheduler.swiftcache`), what it
offers the master. Lenders are simulated first, alone (their own demand always wins, so their
service is the same under every tier policy); their offers are replayed into the master's run.

Glossary (B = the model's KV bytes per token):

    K_i         lender i's KV capacity, bytes;  D_i(t) its own demand (bytes in flight)
    N_i(t)      its allocation by Algorithm 1: ScaleUp at once when D_i > N_i, ScaleDown every
                `check_s` to max D_i over the last `window_s`; both in steps of MEU_i =
                lcm(master block bytes, lender block bytes)
    offer_i(t)  = min(K_i - N_i(t), cap * K_i)      cap: the per-borrower share (ours)

Invariants (by construction):

    reserved <= capacity            a worker's KV, tokens (`WorkerMemory.admit`)
    0 <= N_i(t) <= K_i,  so  0 <= offer_i(t) <= cap * K_i

Timing, on one step clock per model (chunked prefill, FCFS, `chunk_tokens` per step):

    step_s      = prefill_s(n) + sum_j attn_s(n_j, p_j) + decode_s(b, mean context)
    attn_s(n,p) = max(4 L n p H d / (eta_c peak), p B / (eta_m HBM))   the chunk's attention
                  over the p prompt tokens before it (the roofline's terms, which its prefill
                  curve leaves out: it assumes a fresh prompt)

Batching (the same engine for the master and the lenders): a job is admitted FCFS when its
`Memory` says it fits (the head waits otherwise, blocking those behind it); each step prefills
up to `chunk_tokens` of the admitted jobs in arrival order (a job whose load has not ended,
`ready_s`, stops the chunk there) and decodes one token of every job past its prefill; the
step's time is the sum of the prefill and decode terms above (no fused-batch discount). A
lender's demand D_i is the sum of its admitted requests' prompt + output.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fineslab.errors import ConfigError
from fineslab.scheduler.devices import get_device
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.scheduler.roofline import COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY, PRECISIONS
from fineslab.scheduler.swiftcache import scale_down, scale_up  # Algorithm 1, shared

BLOCK_TOKENS = 16  # a KV block (page) of every model, for the elastic unit MEU


# ---- The step engine: one step clock per model ----------------------------------------------

@dataclass(eq=False)
class Job:
    """One request on a step clock: a prompt of `history_tokens` + `input_tokens`."""

    job_id: str
    arrival_s: float
    history_tokens: int
    input_tokens: int
    output_tokens: int
    session_id: str = ""
    recompute_tokens: int = 0  # history tokens prefilled again (the rest is in memory)
    ready_s: float = 0.0  # its load's end; its prefill waits for it
    prefilled_tokens: int = 0
    decoded_tokens: int = 0
    first_token_s: float | None = None
    end_s: float | None = None

    @property
    def prefill_tokens(self) -> int:
        return self.recompute_tokens + self.input_tokens

    @property
    def reserve_tokens(self) -> int:
        return self.history_tokens + self.input_tokens + self.output_tokens

    @property
    def ttft_s(self) -> float:
        return math.inf if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class StepCost:
    """Step latencies of one model from its profile (module docstring, "Timing")."""

    profile: ModelProfile

    def attention_s(self, new_tokens: int, prefix_tokens: int) -> float:
        if new_tokens <= 0 or prefix_tokens <= 0:
            return 0.0
        shape, device = self.profile.shape, get_device(self.profile.device)
        dtype = PRECISIONS[self.profile.precision].compute_dtype \
            if self.profile.precision in PRECISIONS else "fp16"
        flops = 4 * shape.num_layers * new_tokens * prefix_tokens * shape.num_heads \
            * shape.head_dim / self.profile.tp
        compute_s = flops / (COMPUTE_EFFICIENCY * device.peak_flops(dtype))
        memory_s = prefix_tokens * self.profile.kv_token_bytes \
            / (MEMORY_EFFICIENCY * device.hbm_bytes_per_s)
        return max(compute_s, memory_s)

    def step_s(self, pieces: Sequence[tuple[int, int]], batch: int, context: float) -> float:
        """`pieces`: (new tokens, prompt tokens before them) of each prefill in the step."""
        seconds = 0.0
        if pieces:
            seconds += self.profile.prefill_s(sum(n for n, _ in pieces))
            seconds += sum(self.attention_s(n, p) for n, p in pieces)
        if batch:
            seconds += self.profile.decode.step_s(batch, context)
        return seconds


class Memory(Protocol):
    """Who admits a job (and sets its recompute and load) and takes its memory back."""

    def admit(self, job: Job, now: float) -> bool: ...

    def finish(self, job: Job, now: float) -> None: ...


class ChunkedServer:
    """FCFS admission, chunked prefill in arrival order, every admitted decode in each step."""

    def __init__(self, cost: StepCost, memory: Memory, chunk_tokens: int) -> None:
        self.cost, self.memory, self.chunk_tokens = cost, memory, chunk_tokens
        self.now = 0.0
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Job] = deque()
        self.decoding: list[Job] = []

    def admit_waiting(self) -> None:
        while self.waiting and self.memory.admit(self.waiting[0], self.now):
            self.prefilling.append(self.waiting.popleft())

    def can_step(self) -> bool:
        return bool(self.decoding) or bool(self.prefilling and
                                           self.prefilling[0].ready_s <= self.now)

    def wake_s(self) -> float:
        """When a stalled server can step again without a new event (inf: never)."""
        return self.prefilling[0].ready_s if self.prefilling else math.inf

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def step(self) -> list[Job]:
        """One step from `now`; the jobs whose last token it produced."""
        pieces: list[tuple[Job, int, int]] = []
        budget = self.chunk_tokens
        for job in self.prefilling:
            if job.ready_s > self.now or budget == 0:
                break
            n = min(budget, job.prefill_tokens - job.prefilled_tokens)
            pieces.append((job, n, job.history_tokens - job.recompute_tokens
                           + job.prefilled_tokens))
            budget -= n
        batch = len(self.decoding)
        context = sum(j.history_tokens + j.input_tokens + j.decoded_tokens
                      for j in self.decoding) / batch if batch else 0.0
        self.now += self.cost.step_s([(n, p) for _, n, p in pieces], batch, context)
        done = []
        for job in self.decoding:
            job.decoded_tokens += 1
            if job.decoded_tokens >= job.output_tokens:
                done.append(job)
        for job, n, _ in pieces:
            job.prefilled_tokens += n
            if job.prefilled_tokens == job.prefill_tokens:
                self.prefilling.popleft()
                job.first_token_s, job.decoded_tokens = self.now, 1
                (done if job.output_tokens <= 1 else self.decoding).append(job)
        for job in done:
            job.end_s = self.now
            self.memory.finish(job, self.now)
        if done:
            self.decoding = [j for j in self.decoding if j.end_s is None]
        return done



def run_server(server: ChunkedServer, arrivals: Iterable[Job], horizon_s: float,
               offers: Sequence[tuple[float, int, int]] = (),
               on_offer: Callable[[int, int, float], None] | None = None,
               on_done: Callable[[Job], Iterable[Job]] | None = None) -> None:
    """Drive `server` until it is idle with nothing left to arrive, or past `horizon_s`.

    `offers`: (time, lender, bytes) change points, applied at the first step boundary at or
    after their time; `on_done` returns follow-up jobs (a session's next turn)."""
    heap = [(j.arrival_s, j.job_id, j) for j in arrivals]
    heapq.heapify(heap)
    k = 0
    while server.now <= horizon_s:
        while k < len(offers) and offers[k][0] <= server.now:
            if on_offer is not None:
                on_offer(offers[k][1], offers[k][2], offers[k][0])
            k += 1
        while heap and heap[0][0] <= server.now:
            server.waiting.append(heapq.heappop(heap)[2])
        server.admit_waiting()
        if server.can_step():
            for job in server.step():
                for nxt in (on_done(job) if on_done else ()):
                    heapq.heappush(heap, (nxt.arrival_s, nxt.job_id, nxt))
            continue
        if not heap and server.idle():
            break
        next_s = min(heap[0][0] if heap else math.inf, server.wake_s(),
                     offers[k][0] if k < len(offers) else math.inf)
        if math.isinf(next_s):
            break  # a stalled queue with nothing left to change it
        server.now = max(server.now, next_s)


# ---- Lenders: own demand (workers) and Algorithm 1 ------------------------------------------

class WorkerMemory:
    """A worker's own KV: admits while reserved (prompt + output) fits; logs its demand."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens, self.reserved_tokens = capacity_tokens, 0
        self.demand: list[tuple[float, int]] = [(0.0, 0)]  # (time, tokens in flight)

    def admit(self, job: Job, now: float) -> bool:
        if job.reserve_tokens > self.capacity_tokens:
            raise ConfigError(f"{job.job_id}: {job.reserve_tokens} tokens never fit a worker "
                              f"KV of {self.capacity_tokens}")
        if self.reserved_tokens + job.reserve_tokens > self.capacity_tokens:
            return False
        self.reserved_tokens += job.reserve_tokens
        self.demand.append((now, self.reserved_tokens))
        return True

    def finish(self, job: Job, now: float) -> None:
        self.reserved_tokens -= job.reserve_tokens
        self.demand.append((now, self.reserved_tokens))


def elastic_offers(demand_bytes: Sequence[tuple[float, int]], capacity_bytes: int, meu_bytes: int,
                   cap_bytes: int, window_s: float, check_s: float,
                   horizon_s: float) -> list[tuple[float, int]]:
    """offer_i(t) change points: a lender starts holding all of K_i, grows at once when its
    demand outgrows N_i and shrinks at each check to the largest demand of the last window."""
    alloc, offers = capacity_bytes, [(0.0, 0)]
    ticks = [k * check_s for k in range(1, int(horizon_s / check_s) + 1)]
    times = [t for t, _ in demand_bytes]
    events = sorted([(t, 0, d) for t, d in demand_bytes] + [(t, 1, 0) for t in ticks])
    for t, kind, need in events:
        if kind == 0:
            alloc = min(capacity_bytes, alloc + scale_up(alloc, need, meu_bytes))
        else:
            lo = max(0, bisect.bisect_right(times, t - window_s) - 1)  # in force at t - w
            hi = bisect.bisect_right(times, t)
            window_max = max(d for _, d in demand_bytes[lo:hi])
            alloc -= scale_down(alloc, window_max, meu_bytes)
        offer = min(capacity_bytes - alloc, cap_bytes)
        if offer != offers[-1][1]:
            offers.append((t, offer))
    return offers


def simulate_worker(profile: ModelProfile, capacity_tokens: int,
                    requests: Sequence[tuple[float, int, int]],
                    horizon_s: float) -> tuple[list[float], list[tuple[float, int]]]:
    """A lender's own service of (arrival, prompt, output) requests: TTFTs and its demand
    (time, tokens in flight) change points."""
    memory = WorkerMemory(capacity_tokens)
    server = ChunkedServer(StepCost(profile), memory, profile.chunk_tokens)
    jobs = [Job(f"w{k:06d}", t, 0, p, o) for k, (t, p, o) in enumerate(requests)]
    run_server(server, jobs, horizon_s)
    return [j.ttft_s for j in jobs], memory.demand

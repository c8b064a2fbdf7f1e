"""Trace replay for the fragmentation benchmark: workloads, block events, the replay loop, and
the critical arena of a scheme (the smallest arena in which it serves a whole trace).

Glossary
    live bytes      tokens held x that model's real token bytes (what an ideal, token-granular
                    allocator with no padding would hold)
    refusal         an allocation a scheme could not serve; its request is dropped
    fragmentation   a refusal with live bytes + the refused tokens' bytes <= arena bytes: an
      refusal       ideal allocator would have served it; the scheme lost it to waste
    capacity        any other refusal (no allocator could serve it)
      refusal
    critical arena  the smallest arena in which the scheme refuses nothing over the whole trace,
                    found by bisection to within `tolerance x peak live bytes`; its first
                    failure is measured in the largest failing arena of the bisection, which is
                    at least the peak live bytes, so every refusal there is a fragmentation one

Why the critical arena (docs/slabs.md has the measurements): in an arena smaller than the
trace's peak live KV, the first fragmentation refusal comes at the first burst past the arena,
and several schemes refuse the same request there; worse, a scheme that serves that burst and
fails a moment later on a bigger one scores *lower* than one that failed first. At its critical
arena every scheme replays the same history (nothing dropped) up to its own limit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineslab.bench.fragmentation_schemes import Scheme
from fineslab.errors import ConfigError
from fineslab.slabs.formats import KVShape
from fineslab.workload import load_arrival_trace, load_lengths, poisson_arrivals

NUM_SAMPLES = 2000
MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS = 8192, 1024  # the simulator's caps (sim/experiments)
# a float tick like (a + k * tpot - a) / tpot can land just below k; this puts it back
_TICK_EPS = 1e-6
# the bisection's first step above the peak, and how far it may grow before giving up
_FIRST_STEP = 0.01
_MAX_ARENA_OVER_PEAK = 16.0


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    model: np.ndarray
    token_bytes: np.ndarray  # per model
    tpot_s: float

    @classmethod
    def of(cls, arrival_s: np.ndarray, prefill: np.ndarray, decode: np.ndarray,
           tpot_s: float, shapes: tuple[KVShape, ...]) -> Workload:
        """Requests dealt round-robin over `shapes`."""
        token_bytes = np.array([m.token_bytes for m in shapes], dtype=np.int64)
        return cls(np.asarray(arrival_s, dtype=np.float64), np.asarray(prefill, dtype=np.int64),
                   np.asarray(decode, dtype=np.int64), np.arange(len(arrival_s)) % len(shapes),
                   token_bytes, tpot_s)

    @classmethod
    def azure(cls, path: Path, tpot_s: float, shapes: tuple[KVShape, ...]) -> Workload:
        trace = load_arrival_trace(path, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
        return cls.of(trace.arrival_s, trace.lengths.prompt_tokens,
                      trace.lengths.output_tokens, tpot_s, shapes)

    @classmethod
    def sharegpt(cls, path: Path, tpot_s: float, rate_per_s: float, duration_s: float,
                 seed: int, shapes: tuple[KVShape, ...]) -> Workload:
        lengths = load_lengths(path, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
        rng = np.random.default_rng(seed)
        arrival_s = poisson_arrivals(rate_per_s, duration_s, rng)
        rows = rng.integers(0, len(lengths), arrival_s.size)
        return cls.of(arrival_s, lengths.prompt_tokens[rows], lengths.output_tokens[rows],
                      tpot_s, shapes)

    @property
    def end_s(self) -> np.ndarray:
        return self.arrival_s + self.decode_tokens * self.tpot_s

    def live_bytes(self, t: float, alive: np.ndarray) -> float:
        """Real KV bytes held at time t by requests not dropped."""
        live = alive & (self.arrival_s <= t) & (self.end_s > t)
        decoded = np.clip(np.floor((t - self.arrival_s[live]) / self.tpot_s + _TICK_EPS), 0,
                          self.decode_tokens[live])
        tokens = self.prefill_tokens[live] + decoded
        return float(tokens @ self.token_bytes[self.model[live]])

    def peak_live(self) -> tuple[float, float]:
        """(bytes, time) of the highest live bytes with nothing dropped (exact for live_bytes).

        Live bytes change only at a request's arrival (+prompt), its decode ticks (+1 token at
        arrival + k x tpot, 1 <= k < decode) and its end (everything): a sweep over those.
        """
        a, d = self.arrival_s, self.decode_tokens
        token_bytes = self.token_bytes[self.model].astype(np.float64)
        ticks = np.maximum(d - 1, 0)
        request = np.repeat(np.arange(a.size), ticks)
        k = np.arange(ticks.sum()) - np.repeat(np.cumsum(ticks) - ticks, ticks) + 1
        times = np.concatenate([a, a[request] + k * self.tpot_s, self.end_s])
        delta = np.concatenate([self.prefill_tokens * token_bytes, token_bytes[request],
                                -(self.prefill_tokens + ticks) * token_bytes])
        order = np.lexsort((delta, times))  # at one instant, ends before growth
        live = np.cumsum(delta[order])
        top = int(live.argmax())
        return float(live[top]), float(times[order][top])

    def kv_byte_seconds(self) -> np.ndarray:
        """Per request, the integral of its live bytes over its life (exact for live_bytes)."""
        p, d = self.prefill_tokens, self.decode_tokens
        return self.token_bytes[self.model] * self.tpot_s * (d * p + d * (d - 1) / 2)

    def mean_demand_bytes(self) -> np.ndarray:
        """Per model, live bytes averaged over [0, last end] with no memory limit."""
        horizon_s = float(self.end_s.max())
        return np.bincount(self.model, weights=self.kv_byte_seconds(),
                           minlength=self.token_bytes.size) / horizon_s


def matched_rate_per_s(target_mean_bytes: float, prompt: np.ndarray, output: np.ndarray,
                       token_bytes: np.ndarray, tpot_s: float) -> float:
    """The Poisson rate whose mean live KV (Little's law) is `target_mean_bytes`."""
    p, d = prompt.astype(np.float64), output.astype(np.float64)
    per_request = tpot_s * float(np.mean(d * p + d * (d - 1) / 2)) * float(token_bytes.mean())
    return target_mean_bytes / per_request


Events = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def block_events(work: Workload, tokens_per_block: np.ndarray) -> Events:
    """(time, kind 0=alloc 1=free, request, num_blocks), sorted by time, allocs first."""
    tpb = tokens_per_block[work.model]
    first = -(-work.prefill_tokens // tpb)
    total = -(-(work.prefill_tokens + work.decode_tokens) // tpb)
    requests = np.arange(len(tpb))
    extra = total - first
    grow_req = np.repeat(requests, extra)
    block_index = np.arange(extra.sum()) - np.repeat(np.cumsum(extra) - extra, extra) + \
        first[grow_req]
    grow_t = work.arrival_s[grow_req] + (block_index * tpb[grow_req] + 1 -
                                         work.prefill_tokens[grow_req]) * work.tpot_s
    times = np.concatenate([work.arrival_s, grow_t, work.end_s])
    kinds = np.concatenate([np.zeros(len(tpb) + len(grow_t), np.int8), np.ones(len(tpb), np.int8)])
    reqs = np.concatenate([requests, grow_req, requests])
    counts = np.concatenate([first, np.ones(len(grow_t), np.int64), np.zeros(len(tpb), np.int64)])
    order = np.lexsort((kinds, times))
    return times[order], kinds[order], reqs[order], counts[order]


@dataclass(frozen=True)
class Outcome:
    first_failure_util: float | None  # first fragmentation refusal
    first_failure_s: float | None
    first_failure_asked: float | None  # the refused tokens' bytes / arena bytes
    failure_utils: tuple[float, ...]  # every fragmentation refusal
    first_refusal_util: float | None  # first refusal of either kind
    num_capacity_refusals: int
    time_avg_util: float | None  # None when the replay stopped at its first refusal
    num_dropped: int

    @property
    def mean_failure_util(self) -> float | None:
        return float(np.mean(self.failure_utils)) if self.failure_utils else None

    @property
    def served_all(self) -> bool:
        return self.num_dropped == 0


def replay(work: Workload, events: Events, scheme: Scheme, arena_bytes: int,
           stop_at_first_refusal: bool = False) -> Outcome:
    """Run the events through `scheme`, dropping a request whose allocation fails."""
    alive = np.ones(work.arrival_s.size, dtype=bool)
    held: dict[int, list[object]] = {}
    samples = np.linspace(0.0, float(work.end_s.max()), NUM_SAMPLES)
    num_samples = 0 if stop_at_first_refusal else NUM_SAMPLES
    sampled: list[float] = []
    failures: list[tuple[float, float, float]] = []
    refusals: list[float] = []
    times, kinds, reqs, counts = (e.tolist() for e in events)
    models = work.model.tolist()
    for t, kind, request, num_blocks in zip(times, kinds, reqs, counts, strict=True):
        while len(sampled) < num_samples and samples[len(sampled)] <= t:
            sampled.append(work.live_bytes(float(samples[len(sampled)]), alive))
        if not alive[request]:
            continue
        model = models[request]
        if kind == 1:
            scheme.free(model, held.pop(request, []))
            continue
        handle = scheme.alloc(model, num_blocks)
        if handle is None:
            # live_bytes(t) already counts the tokens asked for: the prompt, or the one decode
            # token that opened a new block
            asked = work.prefill_tokens[request] if request not in held else 1
            live_with_asked = work.live_bytes(t, alive)
            asked_bytes = float(asked * work.token_bytes[model])
            util = (live_with_asked - asked_bytes) / arena_bytes
            refusals.append(util)
            if live_with_asked <= arena_bytes:
                failures.append((t, util, asked_bytes / arena_bytes))
            alive[request] = False
            scheme.free(model, held.pop(request, []))
            if stop_at_first_refusal:
                break
            continue
        held.setdefault(request, []).append(handle)
    first = failures[0] if failures else None
    time_avg = float(np.mean(sampled)) / arena_bytes if sampled else None
    return Outcome(first[1] if first else None, first[0] if first else None,
                   first[2] if first else None, tuple(f[1] for f in failures),
                   refusals[0] if refusals else None, len(refusals) - len(failures),
                   time_avg, int((~alive).sum()))


@dataclass(frozen=True)
class CriticalArena:
    """A scheme at its limit: it serves the whole trace in `arena_bytes` and refuses a request
    in `failing_arena_bytes` (within the bisection's tolerance below it)."""

    arena_bytes: int
    failing_arena_bytes: int
    first_failure: Outcome  # the replay in the failing arena, stopped at its first refusal
    num_probes: int


def critical_arena(work: Workload, events: Events, build: Callable[[int], Scheme],
                   peak_bytes: float, tolerance: float = 2e-4) -> CriticalArena:
    """Bisect the arena size between the peak live bytes (no scheme serves the trace in less)
    and the first size that serves it, to within `tolerance x peak_bytes`.

    Bisection assumes that a scheme serving the trace in an arena serves it in any larger one:
    exact for the counting pools; for the slab and first fit placement can change with the
    arena's size, so what is returned is a threshold within the tolerance (served in
    `arena_bytes`, refused in `failing_arena_bytes`), not a proof that no smaller arena serves.
    Cost: one replay per probe, about log2(1 / tolerance) + 2 probes; a failing probe stops at
    its first refusal.
    """
    if not 0 < tolerance < 1:
        raise ConfigError(f"tolerance={tolerance} must be in (0, 1)")
    probes = 0

    def probe(arena_bytes: int) -> Outcome:
        nonlocal probes
        probes += 1
        scheme = build(arena_bytes)
        try:
            return replay(work, events, scheme, arena_bytes, stop_at_first_refusal=True)
        finally:
            scheme.close()

    low = int(np.ceil(peak_bytes))
    low_outcome = probe(low)
    if low_outcome.served_all:
        return CriticalArena(low, low, low_outcome, probes)
    step = max(1, int(peak_bytes * _FIRST_STEP))
    high = low + step
    while not (outcome := probe(high)).served_all:
        low, low_outcome = high, outcome
        step *= 2
        high = low + step
        if high > _MAX_ARENA_OVER_PEAK * peak_bytes:
            raise ConfigError(f"the scheme does not serve the trace even in {high} B "
                              f"({_MAX_ARENA_OVER_PEAK:g}x the peak live bytes)")
    while high - low > max(1.0, tolerance * peak_bytes):  # whole bytes: stop at one apart
        middle = (low + high) // 2
        outcome = probe(middle)
        if outcome.served_all:
            high = middle
        else:
            low, low_outcome = middle, outcome
    return CriticalArena(high, low, low_outcome, probes)

"""SwiftCache (paper 003), a focused discrete-event model: a master's prefix KV in lent memory.

One master model serves multi-turn sessions (closed loop); its prefix cache keeps each session's
history KV in local memory while room allows, least recently used first out. What an eviction
does with the history is the tier policy, chosen by name (`TIERS`):

    recompute   dropped; the next turn prefills history + input
    lend        SwiftCache: kept in lenders' free memory (same-GPU lenders first, then peers),
                up to what each offers; reloaded over that lender's link at the next turn
    host        kept in host memory (LRU within `host_bytes`); reloaded over PCIe (the
                paper's baselines, SGLang HiCache and vLLM + LMCache, offload to CPU memory)

This module holds the tiers and the master. The step engine both sides run on (its step time
and batching) and the lenders' side (their own service, Algorithm 1 and their offers) are in
`lenders.py`.

Glossary (tokens are the master's unless named otherwise; B_m = master KV bytes per token):

    C_m         the master's local KV capacity, tokens
    reserved    sum over admitted turns of (history + input + output): reserved up front
    cached      sum over idle sessions' histories held locally (the local prefix cache)
    offer_i(t)  what lender i offers the master, bytes (Algorithm 1 and the cap, `lenders.py`)
    lent_i      master history bytes held by lender i

Invariants (`check_integrity`, called after every mutation when `check=True`):

    reserved + cached <= C_m
    lent_i == sum of its pieces * B_m <= offer_i   after every event; a fall of offer_i drops
                the oldest pieces on i at once (never moved), with every later piece of those
                sessions (a prefix cache needs a contiguous prefix). The master sees a change
                at its next step boundary (one step late at most, tens of ms); the lender has
                its memory at once (it is simulated first, alone)
    host_used <= host_bytes

Timing of a turn (step_s, the step clock's, is in `lenders.py`):

    load_s      = sum over pieces of bytes / link bytes/s   (pieces one after another, on one
                  FIFO channel per master; the turn's prefill waits for its load)
    TTFT        = end of the step that prefills the turn's last token - arrival
                = queueing + load_s + prefill of (recomputed history + input), in steps

Admission: a turn is admitted FCFS when its history + input + output fit the free KV (the
master evicts idle histories, LRU, to make room; the head waits otherwise, blocking those
behind it). The lent and host tiers drop their own least recently stored histories when a new
one does not fit; a finished session's history stays cached like any other (a server cannot
know that a chat ended).

Not modelled: layer-wise overlap of a load with compute (the paper's section 3.3; loads here
are not hidden, an upper bound on their cost), the store of evicted pages (asynchronous in
both systems), PCIe shared by several GPUs, page granularity (a history is whole tokens),
the layer stream cache (longer contexts), interference of copies with a lender's steps (the
paper measures <= 9.7 %): a lender's own demand always wins at once, so its service is the
same under every policy, and workers are simulated once, before the master.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fineslab.errors import ConfigError
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.sim.lenders import ChunkedServer, Job, StepCost, run_server

# ---- Tiers: where evicted histories go ------------------------------------------------------

@dataclass(frozen=True)
class Fetch:
    """What a tier gives back for a session: a prefix of `tokens`, after `load_s`."""

    tokens: int = 0
    load_s: float = 0.0


class PrefixTier(Protocol):
    """Where evicted histories go (module docstring). `store` keeps a prefix and says how long;
    `take` removes the session's prefix and prices its reload; `set_offer` is a lender's change."""

    name: str
    reloaded_bytes: int
    drops: int
    dropped_tokens: int
    peak_bytes: int

    def store(self, session_id: str, tokens: int, now: float) -> int: ...

    def take(self, session_id: str) -> Fetch: ...

    def set_offer(self, lender: int, offer_bytes: int, now: float) -> None: ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True)
class TierContext:
    """What a tier is built from: the master's KV bytes per token, the lenders, the host."""

    token_bytes: int
    lender_links_bytes_per_s: tuple[float, ...] = ()  # in preference order
    host_bytes: int = 0
    host_link_bytes_per_s: float = 1.0


@dataclass
class _Stats:
    reloaded_bytes: int = 0
    drops: int = 0
    dropped_tokens: int = 0
    peak_bytes: int = 0  # the most the tier held at once


class RecomputeTier(_Stats):
    name = "recompute"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__()

    def store(self, session_id: str, tokens: int, now: float) -> int:
        return 0

    def take(self, session_id: str) -> Fetch:
        return Fetch()

    def set_offer(self, lender: int, offer_bytes: int, now: float) -> None:
        pass

    def check_integrity(self) -> None:
        pass


class HostTier(_Stats):
    name = "host"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__()
        self.ctx, self.used_bytes = ctx, 0
        self.entries: OrderedDict[str, int] = OrderedDict()  # session -> tokens, LRU first

    def store(self, session_id: str, tokens: int, now: float) -> int:
        self.used_bytes -= self.entries.pop(session_id, 0) * self.ctx.token_bytes
        tokens = min(tokens, self.ctx.host_bytes // self.ctx.token_bytes)
        while self.entries and self.used_bytes + tokens * self.ctx.token_bytes > \
                self.ctx.host_bytes:
            _, old = self.entries.popitem(last=False)
            self.used_bytes -= old * self.ctx.token_bytes
        if tokens > 0:
            self.entries[session_id] = tokens
            self.used_bytes += tokens * self.ctx.token_bytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return tokens

    def take(self, session_id: str) -> Fetch:
        tokens = self.entries.pop(session_id, 0)
        moved = tokens * self.ctx.token_bytes
        self.used_bytes -= moved
        self.reloaded_bytes += moved
        return Fetch(tokens, moved / self.ctx.host_link_bytes_per_s)

    def set_offer(self, lender: int, offer_bytes: int, now: float) -> None:
        pass

    def check_integrity(self) -> None:
        total = sum(self.entries.values()) * self.ctx.token_bytes
        assert total == self.used_bytes <= self.ctx.host_bytes, "host tier ledger is off"


@dataclass
class _Lender:
    link_bytes_per_s: float
    offer_bytes: int = 0
    lent_bytes: int = 0
    pieces: OrderedDict[str, int] = field(default_factory=OrderedDict)  # oldest first


class LendTier(_Stats):
    """SwiftCache: a history's prefix in pieces over the lenders, in preference order."""

    name = "lend"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.lenders = [_Lender(bw) for bw in ctx.lender_links_bytes_per_s]
        self.sessions: dict[str, list[tuple[int, int]]] = {}  # (lender, tokens), prefix order

    def store(self, session_id: str, tokens: int, now: float) -> int:
        """Place a prefix of `tokens`, evicting the tier's oldest histories (LRU, as the
        local cache) while the lenders' room is short of it; an older copy is replaced."""
        if session_id in self.sessions:
            self._truncate(session_id, None)
        while self.sessions and self._room_tokens() < tokens:
            self._truncate(next(iter(self.sessions)), None)
        pieces, left = [], tokens
        for i, lender in enumerate(self.lenders):
            put = min(left, (lender.offer_bytes - lender.lent_bytes) // self.ctx.token_bytes)
            if put > 0:
                pieces.append((i, put))
                lender.pieces[session_id] = put
                lender.lent_bytes += put * self.ctx.token_bytes
                left -= put
        if pieces:
            self.sessions[session_id] = pieces
            self.peak_bytes = max(self.peak_bytes, sum(x.lent_bytes for x in self.lenders))
        return tokens - left

    def take(self, session_id: str) -> Fetch:
        tokens, load_s = 0, 0.0
        for i, put in self.sessions.pop(session_id, []):
            lender, moved = self.lenders[i], put * self.ctx.token_bytes
            del lender.pieces[session_id]
            lender.lent_bytes -= moved
            self.reloaded_bytes += moved
            tokens, load_s = tokens + put, load_s + moved / lender.link_bytes_per_s
        return Fetch(tokens, load_s)

    def set_offer(self, lender: int, offer_bytes: int, now: float) -> None:
        """The lender's own demand wins at once: its oldest pieces go until lent <= offer."""
        self.lenders[lender].offer_bytes = offer_bytes
        while self.lenders[lender].lent_bytes > offer_bytes:
            self._truncate(next(iter(self.lenders[lender].pieces)), lender)

    def _room_tokens(self) -> int:
        return sum(max(0, lender.offer_bytes - lender.lent_bytes) // self.ctx.token_bytes
                   for lender in self.lenders)

    def _truncate(self, session_id: str, lender: int | None) -> None:
        """Drop the session's piece on `lender` and every piece after it (prefix order): a
        lender's reclaim (a drop); `lender=None` drops them all (an LRU eviction)."""
        pieces = self.sessions[session_id]
        cut = 0 if lender is None else next(k for k, (i, _) in enumerate(pieces) if i == lender)
        for i, put in pieces[cut:]:
            del self.lenders[i].pieces[session_id]
            self.lenders[i].lent_bytes -= put * self.ctx.token_bytes
            if lender is not None:
                self.dropped_tokens += put
        self.drops += lender is not None
        if cut:
            self.sessions[session_id] = pieces[:cut]
        else:
            del self.sessions[session_id]

    def check_integrity(self) -> None:
        for k, lender in enumerate(self.lenders):
            held = sum(lender.pieces.values()) * self.ctx.token_bytes
            assert held == lender.lent_bytes <= max(lender.offer_bytes, 0), \
                f"lender {k}: lent {lender.lent_bytes} B, pieces {held} B, offer " \
                f"{lender.offer_bytes} B"
        for sid, pieces in self.sessions.items():
            assert all(self.lenders[i].pieces.get(sid) == put for i, put in pieces), sid


TIERS: dict[str, Callable[[TierContext], PrefixTier]] = {
    "recompute": RecomputeTier, "host": HostTier, "lend": LendTier}


def make_tier(name: str, ctx: TierContext) -> PrefixTier:
    if name not in TIERS:
        raise ConfigError(f"unknown prefix tier policy {name!r}; known: {sorted(TIERS)}")
    return TIERS[name](ctx)

# ---- The master: a local prefix cache over a tier -------------------------------------------

@dataclass(frozen=True)
class TurnRecord:
    """One master turn: where its history came from (tokens) and what the reload cost."""

    arrival_s: float
    ttft_s: float
    history_tokens: int
    input_tokens: int
    local_tokens: int
    tier_tokens: int
    recompute_tokens: int
    load_s: float


class PrefixCache:
    """The master's local KV: reserved turns + an LRU of idle sessions' histories."""

    def __init__(self, capacity_tokens: int, tier: PrefixTier, check: bool = False) -> None:
        self.capacity_tokens, self.tier, self.check = capacity_tokens, tier, check
        self.reserved_tokens = self.cached_tokens = 0
        self.local: OrderedDict[str, int] = OrderedDict()  # session -> history, LRU first
        self.channel_free_s = 0.0  # the master's load channel (FIFO)
        self.sources: dict[str, tuple[int, int, float]] = {}  # job -> (local, tier, load_s)

    def admit(self, job: Job, now: float) -> bool:
        own = self.local.get(job.session_id, 0)
        need = job.reserve_tokens - own
        free = self.capacity_tokens - self.reserved_tokens - self.cached_tokens
        if free + self.cached_tokens - own < need:
            return False
        for victim in [s for s in self.local if s != job.session_id]:
            if free >= need:
                break
            tokens = self.local.pop(victim)
            self.cached_tokens -= tokens
            free += tokens
            self.tier.store(victim, tokens, now)
        if own:
            del self.local[job.session_id]
            self.cached_tokens -= own
            fetch = Fetch()
        else:
            fetch = self.tier.take(job.session_id)
        job.recompute_tokens = job.history_tokens - own - fetch.tokens
        if fetch.load_s > 0:
            self.channel_free_s = job.ready_s = max(now, self.channel_free_s) + fetch.load_s
        self.reserved_tokens += job.reserve_tokens
        self.sources[job.job_id] = (own, fetch.tokens, fetch.load_s)
        self.check_integrity()
        return True

    def finish(self, job: Job, now: float) -> None:
        self.reserved_tokens -= job.reserve_tokens
        self.local[job.session_id] = job.reserve_tokens  # the next turn's history
        self.cached_tokens += job.reserve_tokens
        self.check_integrity()

    def set_offer(self, lender: int, offer_bytes: int, now: float) -> None:
        self.tier.set_offer(lender, offer_bytes, now)
        self.check_integrity()

    def check_integrity(self) -> None:
        if not self.check:
            return
        assert self.cached_tokens == sum(self.local.values()), "local ledger is off"
        assert self.reserved_tokens + self.cached_tokens <= self.capacity_tokens, \
            "local KV over capacity"
        self.tier.check_integrity()


@dataclass
class MasterResult:
    """Every measured turn of the master, and its tier's counters."""

    turns: list[TurnRecord]
    tier: PrefixTier
    end_s: float


def session_jobs(session_turns: Sequence[Sequence[tuple[int, int, int, float]]],
                 starts_s: Sequence[float], session_ids: Sequence[str]) -> list[Job]:
    """Turn 0 of each session as a job (later turns follow replies, `simulate_master`)."""
    return [Job(f"{sid}-t000", start, 0, turns[0][1], turns[0][2], session_id=sid)
            for sid, start, turns in zip(session_ids, starts_s, session_turns, strict=True)]


def simulate_master(profile: ModelProfile, capacity_tokens: int,
                    sessions: Mapping[str, Sequence[tuple[int, int, int, float]]],
                    starts_s: Mapping[str, float], tier: PrefixTier, horizon_s: float,
                    offers: Sequence[tuple[float, int, int]] = (),
                    check: bool = False) -> MasterResult:
    """Serve `sessions` (id -> turns of (history, input, output, think_s)) closed loop: turn
    k + 1 arrives think_s after turn k's last token. Every turn is recorded, served or not."""
    cache = PrefixCache(capacity_tokens, tier, check)
    server = ChunkedServer(StepCost(profile), cache, profile.chunk_tokens)
    jobs: list[Job] = []

    def next_turn(job: Job) -> list[Job]:
        turns = sessions[job.session_id]
        k = int(job.job_id.rsplit("-t", 1)[1]) + 1
        if k >= len(turns):
            return []
        history, new, out, think_s = turns[k]
        nxt = Job(f"{job.session_id}-t{k:03d}", (job.end_s or 0.0) + think_s, history, new,
                  out, session_id=job.session_id)
        jobs.append(nxt)
        return [nxt]

    jobs += session_jobs(list(sessions.values()), [starts_s[s] for s in sessions],
                         list(sessions))
    run_server(server, list(jobs), horizon_s, offers, cache.set_offer, next_turn)
    records = []
    for job in jobs:
        own, fetched, load_s = cache.sources.get(job.job_id, (0, 0, 0.0))
        records.append(TurnRecord(job.arrival_s, job.ttft_s, job.history_tokens,
                                  job.input_tokens, own, fetched,
                                  job.recompute_tokens if job.job_id in cache.sources
                                  else job.history_tokens, load_s))
    return MasterResult(records, tier, server.now)

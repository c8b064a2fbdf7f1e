"""Multi-turn chat sessions: the workload whose prompts share a growing prefix (SwiftCache, 003).

A chat turn is sent as one request whose prompt is the whole conversation so far (the history)
followed by the user's new message; a prefix cache that still holds the history's KV pairs only
has to prefill the new tokens. This module draws such conversations:

    session starts   a Poisson process of `session_rate_per_s` (gaps ~ Exp(rate), from 0)
    planned turns    min(Geometric(p = 1 / mean_turns), max_turns), so at least 1
    turn lengths     (input, output) rows of a `LengthTable`, drawn with replacement; turn 0 is
                     drawn among the rows that fit the context on their own, so no session is
                     empty
    think time       Exp(think_mean_s) before each later turn, after the previous reply

Glossary and invariants, for a session's turns k = 0 .. n-1:

    history_tokens[0] = 0
    history_tokens[k] = history_tokens[k-1] + input_tokens[k-1] + output_tokens[k-1]
    history_tokens[k] + input_tokens[k] + output_tokens[k] <= max_context_tokens
    1 <= n <= planned_turns <= max_turns      (n < planned_turns: the context cap ended it)
    think_s[0] = 0;  start_s of turn 0 = the session's start, None for later turns

A later turn's send time depends on how long the previous reply took, so the generator leaves
it open: a closed-loop caller sends turn k at (end of reply k-1) + think_s[k];
`open_loop_requests` fixes every reply's duration in advance and gives the times for a simulator.

`build_sessions` is a pure function of its spec (seed included), like `build_workload`. Cost: a
few bulk numpy draws and one Python pass over the turns (10,000 sessions of 5 turns in about
0.2 s on ShareGPT lengths).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fineslab.errors import ConfigError
from fineslab.workload.traces import LengthTable


@dataclass(frozen=True, eq=False)
class SessionSpec:
    """What to draw: `num_sessions` chats with `model`, their lengths from `lengths`.

    The defaults (mean 5 turns, 5 s think time, a 32k context) are chat-like, not measured.
    """

    model: str
    lengths: LengthTable
    num_sessions: int
    session_rate_per_s: float
    mean_turns: float = 5.0
    max_turns: int = 64
    think_mean_s: float = 5.0
    max_context_tokens: int = 32768
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("SessionSpec.model must be a non-empty model name")
        _require(self.num_sessions >= 1, "num_sessions", "must be at least 1", self.num_sessions)
        _require(math.isfinite(self.session_rate_per_s) and self.session_rate_per_s > 0,
                 "session_rate_per_s", "must be a positive number", self.session_rate_per_s)
        _require(self.max_turns >= 1, "max_turns", "must be at least 1", self.max_turns)
        _require(1 <= self.mean_turns <= self.max_turns, "mean_turns",
                 f"must be in [1, max_turns={self.max_turns}]", self.mean_turns)
        _require(math.isfinite(self.think_mean_s) and self.think_mean_s >= 0, "think_mean_s",
                 "must be a non-negative number", self.think_mean_s)
        _require(self.seed >= 0, "seed", "must be non-negative", self.seed)
        shortest = int((self.lengths.prompt_tokens + self.lengths.output_tokens).min())
        _require(shortest <= self.max_context_tokens, "max_context_tokens",
                 f"must hold at least one turn of the length table (the shortest has "
                 f"{shortest} tokens)", self.max_context_tokens)

    @property
    def expected_planned_turns(self) -> float:
        """E[min(G, max_turns)] for G ~ Geometric(1 / mean_turns): sum_{k<K} P(G > k)."""
        p = 1.0 / self.mean_turns
        return (1.0 - (1.0 - p) ** self.max_turns) / p

    def fitting_rows(self) -> np.ndarray:
        """Rows of the length table whose input + output fit the context alone (turn 0's pool)."""
        total = self.lengths.prompt_tokens + self.lengths.output_tokens
        return np.flatnonzero(total <= self.max_context_tokens)


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"SessionSpec.{name} {rule}, got {value!r}")


@dataclass(frozen=True)
class SessionTurn:
    """One request of a session: its prompt is `history_tokens` of prefix + `input_tokens` new."""

    session_id: str
    model: str
    turn_index: int
    history_tokens: int
    input_tokens: int
    output_tokens: int
    think_s: float  # the user's pause after the previous reply; 0 for turn 0
    start_s: float | None  # the session's start for turn 0; later turns wait on replies

    @property
    def request_id(self) -> str:
        return f"{self.session_id}-t{self.turn_index:03d}"

    @property
    def prompt_tokens(self) -> int:
        """What the server is sent: the whole history and the new message."""
        return self.history_tokens + self.input_tokens


@dataclass(frozen=True)
class Session:
    """One conversation; `planned_turns` > len(turns) when the context cap ended it early."""

    session_id: str
    start_s: float
    turns: tuple[SessionTurn, ...]
    planned_turns: int

    @property
    def model(self) -> str:
        return self.turns[0].model

    @property
    def truncated(self) -> bool:
        return len(self.turns) < self.planned_turns


def build_sessions(spec: SessionSpec) -> list[Session]:
    """The sessions of `spec`, in start order (ids `<model>-s<index>`)."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_sessions
    starts_s = np.cumsum(rng.exponential(1.0 / spec.session_rate_per_s, size=n))
    planned = np.minimum(rng.geometric(1.0 / spec.mean_turns, size=n), spec.max_turns)
    fitting = spec.fitting_rows()
    first_rows = fitting[rng.integers(0, fitting.size, size=n)]
    num_later = int((planned - 1).sum())
    later_rows = rng.integers(0, len(spec.lengths), size=num_later)
    later_think_s = rng.exponential(spec.think_mean_s, size=num_later)
    sessions, offset = [], 0
    for i in range(n):
        count = int(planned[i]) - 1
        rows = [int(first_rows[i]), *later_rows[offset:offset + count].tolist()]
        think_s = [0.0, *later_think_s[offset:offset + count].tolist()]
        offset += count
        sessions.append(_session(spec, f"{spec.model}-s{i:06d}", float(starts_s[i]), rows,
                                 think_s))
    return sessions


def _session(spec: SessionSpec, session_id: str, start_s: float, rows: list[int],
             think_s: list[float]) -> Session:
    """Walk the planned turns, growing the history, until one would overflow the context."""
    turns: list[SessionTurn] = []
    history_tokens = 0
    for k, (row, think) in enumerate(zip(rows, think_s, strict=True)):
        input_tokens = int(spec.lengths.prompt_tokens[row])
        output_tokens = int(spec.lengths.output_tokens[row])
        if history_tokens + input_tokens + output_tokens > spec.max_context_tokens:
            break
        turns.append(SessionTurn(session_id, spec.model, k, history_tokens, input_tokens,
                                 output_tokens, think, start_s if k == 0 else None))
        history_tokens += input_tokens + output_tokens
    return Session(session_id, start_s, tuple(turns), planned_turns=len(rows))


@dataclass(frozen=True)
class TimedTurn:
    """A turn and the time (s) an open-loop client sends it."""

    arrival_s: float
    turn: SessionTurn


def open_loop_requests(sessions: Sequence[Session],
                       reply_s: Callable[[SessionTurn], float] | float) -> list[TimedTurn]:
    """Every turn's send time when each reply takes `reply_s` (a constant or per turn):

        arrival[0] = start_s;  arrival[k] = arrival[k-1] + reply_s(turn[k-1]) + think_s[k]

    Sorted by arrival (ties by request id). A live closed loop uses the measured reply end
    instead; this is its stand-in for the simulator and for planning a run's length.
    """
    timed: list[TimedTurn] = []
    for session in sessions:
        arrival_s = session.start_s
        for k, turn in enumerate(session.turns):
            if k > 0:
                arrival_s += _reply_s(reply_s, session.turns[k - 1]) + turn.think_s
            timed.append(TimedTurn(arrival_s, turn))
    timed.sort(key=lambda t: (t.arrival_s, t.turn.request_id))
    return timed


def _reply_s(reply_s: Callable[[SessionTurn], float] | float, turn: SessionTurn) -> float:
    seconds = float(reply_s(turn)) if callable(reply_s) else float(reply_s)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"reply_s must be a non-negative number of seconds, got {seconds} "
                          f"for {turn.request_id}")
    return seconds


@dataclass(frozen=True)
class SessionStats:
    """Totals over a session set; `reusable_prefix_fraction` is what a prefix cache can save."""

    num_sessions: int
    num_turns: int
    num_truncated: int  # sessions the context cap ended before their planned turns
    mean_history_tokens_by_turn: tuple[float, ...]  # [k]: over the sessions that reach turn k
    history_tokens: int
    input_tokens: int
    output_tokens: int

    @property
    def mean_turns(self) -> float:
        return self.num_turns / self.num_sessions

    @property
    def reusable_prefix_fraction(self) -> float:
        """sum(history) / sum(history + input): the prompt share a warm prefix cache skips."""
        return self.history_tokens / (self.history_tokens + self.input_tokens)


def summarize_sessions(sessions: Sequence[Session]) -> SessionStats:
    """The `SessionStats` of `sessions` (at least one)."""
    if not sessions:
        raise ConfigError("cannot summarize an empty session set")
    depth = max(len(s.turns) for s in sessions)
    history_sum = np.zeros(depth, dtype=np.float64)
    reached = np.zeros(depth, dtype=np.int64)
    turns = [t for s in sessions for t in s.turns]
    for turn in turns:
        history_sum[turn.turn_index] += turn.history_tokens
        reached[turn.turn_index] += 1
    return SessionStats(
        num_sessions=len(sessions),
        num_turns=len(turns),
        num_truncated=sum(s.truncated for s in sessions),
        mean_history_tokens_by_turn=tuple((history_sum / reached).tolist()),
        history_tokens=sum(t.history_tokens for t in turns),
        input_tokens=sum(t.input_tokens for t in turns),
        output_tokens=sum(t.output_tokens for t in turns),
    )

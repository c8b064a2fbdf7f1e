"""Multi-turn chat sessions (fineslab.workload.sessions): growing prefixes, Poisson starts."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from fineslab.errors import ConfigError
from fineslab.workload import (
    SHAREGPT_STATS,
    LengthTable,
    Session,
    SessionSpec,
    SessionTurn,
    build_sessions,
    load_lengths,
    open_loop_requests,
    summarize_sessions,
)

#: Every turn adds 100 new input tokens and 50 output tokens: histories are exact multiples.
FLAT = LengthTable(np.array([100]), np.array([50]))


@pytest.fixture(scope="module")
def sharegpt() -> LengthTable:
    return load_lengths(SHAREGPT_STATS)


def _spec(**overrides: object) -> SessionSpec:
    fields: dict[str, object] = dict(model="m", lengths=FLAT, num_sessions=300,
                                     session_rate_per_s=2.0, mean_turns=5.0, max_turns=64,
                                     think_mean_s=3.0, max_context_tokens=1_000_000, seed=0)
    fields.update(overrides)
    return SessionSpec(**fields)  # type: ignore[arg-type]


def test_same_seed_same_sessions_other_seed_differs(sharegpt: LengthTable) -> None:
    first = build_sessions(_spec(lengths=sharegpt, seed=7))
    assert build_sessions(_spec(lengths=sharegpt, seed=7)) == first, "a pure function of its spec"
    assert build_sessions(_spec(lengths=sharegpt, seed=8)) != first, "another seed, other sessions"
    ids = [t.request_id for s in first for t in s.turns]
    assert len(set(ids)) == len(ids), "request ids are unique over the set"
    assert [s.start_s for s in first] == sorted(s.start_s for s in first)


def test_history_grows_by_the_previous_turn(sharegpt: LengthTable) -> None:
    for session in build_sessions(_spec(lengths=sharegpt)):
        first = session.turns[0]
        assert (first.history_tokens, first.think_s, first.start_s) == (0, 0.0, session.start_s)
        for prev, turn in pairwise(session.turns):
            assert turn.history_tokens == (prev.history_tokens + prev.input_tokens
                                           + prev.output_tokens), "history = all earlier turns"
            assert turn.turn_index == prev.turn_index + 1
            assert turn.start_s is None, "a later turn's send time waits on the reply"
            assert turn.think_s >= 0
            assert turn.prompt_tokens == turn.history_tokens + turn.input_tokens


def test_context_cap_ends_sessions_exactly() -> None:
    # 150 tokens a turn: a 1,000-token context holds 6 turns (900), never a 7th (1,050).
    sessions = build_sessions(_spec(mean_turns=20.0, max_context_tokens=1000))
    assert all(len(s.turns) == min(s.planned_turns, 6) for s in sessions)
    assert sum(s.truncated for s in sessions) > 100, "the cap must actually bind here"
    loose = build_sessions(_spec(mean_turns=20.0))
    assert not any(s.truncated for s in loose), "control: a huge context truncates nothing"
    assert max(len(s.turns) for s in loose) > 6


def test_context_cap_holds_on_sharegpt_lengths(sharegpt: LengthTable) -> None:
    sessions = build_sessions(_spec(lengths=sharegpt, mean_turns=8.0, max_context_tokens=8192))
    for turn in (t for s in sessions for t in s.turns):
        assert turn.history_tokens + turn.input_tokens + turn.output_tokens <= 8192
    assert summarize_sessions(sessions).num_truncated > 0, "long ShareGPT rows hit 8k"


def test_turn_zero_is_drawn_among_rows_that_fit() -> None:
    lengths = LengthTable(np.array([100, 50_000]), np.array([50, 10_000]))
    sessions = build_sessions(_spec(lengths=lengths, max_context_tokens=1000))
    assert all(s.turns and s.turns[0].input_tokens == 100 for s in sessions), "no empty session"
    with pytest.raises(ConfigError, match="max_context_tokens"):
        _spec(lengths=lengths, max_context_tokens=149)


def _rate_within(sessions: list[Session], rate_per_s: float, rel: float) -> bool:
    observed = len(sessions) / sessions[-1].start_s
    return abs(observed - rate_per_s) / rate_per_s < rel


def test_session_arrival_rate_and_a_negative_control() -> None:
    sessions = build_sessions(_spec(num_sessions=4000, mean_turns=1.0, session_rate_per_s=2.0))
    # n = 4,000 exponential gaps: the rate estimate has a CV of 1/sqrt(n), about 1.6%.
    assert _rate_within(sessions, 2.0, rel=0.08), "Poisson starts at 2 sessions/s"
    gaps = np.diff([0.0, *(s.start_s for s in sessions)])
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.08, "exponential gaps have CV 1"
    faster = build_sessions(_spec(num_sessions=4000, mean_turns=1.0, session_rate_per_s=2.5))
    assert not _rate_within(faster, 2.0, rel=0.08), "control: 2.5/s must fail the 2/s bound"


def test_turn_count_mean_near_spec() -> None:
    spec = _spec(num_sessions=5000, mean_turns=6.0)
    planned = np.array([s.planned_turns for s in build_sessions(spec)])
    assert planned.min() >= 1 and planned.max() <= 64
    # Geometric(1/6): sd about 5.5, so the mean of 5,000 has an sd of about 0.08.
    assert planned.mean() == pytest.approx(6.0, rel=0.05)
    capped = _spec(num_sessions=5000, mean_turns=4.0, max_turns=4)
    counts = [len(s.turns) for s in build_sessions(capped)]
    assert max(counts) == 4, "max_turns caps every session"
    assert np.mean(counts) == pytest.approx(capped.expected_planned_turns, rel=0.05)
    assert capped.expected_planned_turns < 2.8, "the cap lowers the mean below 4"


def test_reusable_prefix_fraction_grows_with_turns() -> None:
    fractions = [summarize_sessions(build_sessions(_spec(mean_turns=m))).reusable_prefix_fraction
                 for m in (1.0, 2.0, 4.0, 8.0)]
    assert fractions[0] == 0.0, "single-turn sessions reuse nothing"
    assert fractions == sorted(fractions) and len(set(fractions)) == 4, f"grows: {fractions}"
    stats = summarize_sessions(build_sessions(_spec(mean_turns=8.0)))
    assert stats.mean_history_tokens_by_turn[:4] == (0.0, 150.0, 300.0, 450.0), "150 a turn"
    assert stats.num_turns == sum(len(s.turns) for s in build_sessions(_spec(mean_turns=8.0)))


def test_open_loop_times_follow_reply_plus_think() -> None:
    sessions = build_sessions(_spec(num_sessions=50))

    def reply_s(turn: SessionTurn) -> float:
        return 0.01 * turn.output_tokens + 0.001 * turn.input_tokens

    for reply in (1.5, reply_s):
        timed = open_loop_requests(sessions, reply)
        assert len(timed) == sum(len(s.turns) for s in sessions)
        assert [t.arrival_s for t in timed] == sorted(t.arrival_s for t in timed)
        at = {t.turn.request_id: t.arrival_s for t in timed}
        for session in sessions:
            assert at[session.turns[0].request_id] == session.start_s
            for prev, turn in pairwise(session.turns):
                took = reply if isinstance(reply, float) else reply(prev)
                assert at[turn.request_id] == pytest.approx(
                    at[prev.request_id] + took + turn.think_s), "next = reply end + think"
    with pytest.raises(ConfigError, match="reply_s"):
        open_loop_requests(sessions, -1.0)


@pytest.mark.parametrize(("field", "value"), [
    ("num_sessions", 0), ("session_rate_per_s", 0.0), ("session_rate_per_s", float("inf")),
    ("mean_turns", 0.5), ("mean_turns", 100.0), ("max_turns", 0), ("think_mean_s", -1.0),
    ("max_context_tokens", 10), ("seed", -1), ("model", ""),
])
def test_bad_spec_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        _spec(**{field: value})


def test_summary_of_nothing_is_an_error() -> None:
    with pytest.raises(ConfigError, match="empty"):
        summarize_sessions([])

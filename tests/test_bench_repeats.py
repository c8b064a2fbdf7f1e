"""fineslab.bench.repeats: medians with their spread, and interleaved rounds (#38)."""

from __future__ import annotations

import pytest

from fineslab.bench.repeats import interleave, ratios, spread


def test_spread_is_the_median_with_its_min_max_and_count() -> None:
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([1.23456], 3) == {"median": 1.235, "min": 1.235, "max": 1.235, "n": 1}
    with pytest.raises(ValueError):
        spread([])


def test_each_round_runs_every_side_once_and_the_first_side_rotates() -> None:
    calls: list[tuple[str, int]] = []

    def side(name: str) -> object:
        return lambda r: calls.append((name, r)) or f"{name}{r}"

    out = interleave({"a": side("a"), "b": side("b"), "c": side("c")}, 4)
    assert out == {n: [f"{n}{r}" for r in range(4)] for n in "abc"}
    firsts = [calls[3 * r][0] for r in range(4)]
    assert firsts == ["a", "b", "c", "a"], calls
    assert all({name for name, r2 in calls if r2 == r} == set("abc") for r in range(4))
    with pytest.raises(ValueError):
        interleave({"a": side("a")}, 0)


def test_ratios_are_round_by_round() -> None:
    assert ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])

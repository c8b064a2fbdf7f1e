"""Repeated timings, reported as a median with its spread, and sides compared in interleaved
rounds (#38: one run on a noisy machine gave the key-pool allocation ratio 0.99, 2.12, 1.57 and
2.23 in four tries).

- `spread(values)`: {"median", "min", "max", "n"}: what a benchmark prints for every figure
  it timed more than once, so a reader sees how far one run can stray.
- `interleave(sides, rounds)`: each round runs every side once, the first side rotating from
  round to round, so a slow moment of the machine lands on each side alike, not on whichever
  happened to run then.
- `ratios(numerators, denominators)`: the round-by-round ratios of two interleaved sides; their
  median is the benchmark's ratio, their min and max its spread.
- `merge_rounds(rounds, keys, ...)`: several rounds' figures as one entry: counts summed, peaks
  the highest, the rest the median of the rounds (the timed ones with their spread).
- `timed_rounds(steps, sync, rounds)`: seconds of each step (a device copy, a forward pass), one
  per round, interleaved, each step run once first untimed and every call timed to the device's
  completion (`sync`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def spread(values: Sequence[float], digits: int = 2) -> dict[str, float]:
    """The median of `values` (at least one) with its min and max, and how many there were."""
    if not values:
        raise ValueError("no values to summarise")
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "n": len(values)}


def interleave(sides: Mapping[str, Callable[[int], T]], rounds: int,
               progress: Callable[[str, int, T], None] | None = None) -> dict[str, list[T]]:
    """Each side's results, one per round; round r calls every side once with r, starting
    with side r mod the number of sides."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    names = list(sides)
    out: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(sides[name](r))
            if progress is not None:
                progress(name, r, out[name][-1])
    return out


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round-by-round `numerators[r] / denominators[r]`."""
    if len(numerators) != len(denominators):
        raise ValueError("one numerator per denominator")
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


def merge_rounds(rounds: Sequence[Mapping[str, Any]], keys: Iterable[str], *,
                 summed: Sequence[str] = (), highest: Sequence[str] = (),
                 with_spread: Sequence[str] = (), digits: int = 4) -> dict[str, Any]:
    """`keys` of the rounds' figures as one entry: those in `summed` summed, in `highest` the
    highest, the rest the median of the rounds that have a value (None when none has), those in
    `with_spread` also as `<key>_spread` (`spread`)."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in rounds if r[key] is not None]
        if key in summed:
            out[key] = sum(values)
        elif key in highest:
            out[key] = max(values, default=None)
        else:
            out[key] = round(statistics.median(values), digits) if values else None
        if key in with_spread and values:
            out[f"{key}_spread"] = spread(values, digits)
    return out


def timed_rounds(steps: Mapping[str, Callable[[], object]], sync: Callable[[], None],
                 rounds: int) -> dict[str, list[float]]:
    """Each step's seconds, one per round, the rounds interleaved (`interleave`); every step
    runs once untimed first (first-touch and first-call costs)."""
    for step in steps.values():
        step()
        sync()

    def timed(step: Callable[[], object]) -> Callable[[int], float]:
        def one(_round: int) -> float:
            sync()
            start_s = time.perf_counter()
            step()
            sync()
            return time.perf_counter() - start_s
        return one

    return interleave({name: timed(step) for name, step in steps.items()}, rounds)

"""Piecewise-linear curves: the one numeric shape every profile table is read through.

A profile stores measured or modelled points `(x, y)` (tokens -> seconds, batch -> tokens/s,
KV bytes -> tokens/s). Between points we interpolate linearly; beyond the last point we extend
the last segment's slope (a longer prefill costs what the last profiled chunk rate says), and
below the first point we extend the first segment's slope, clamped at y >= 0.

Invariants checked on construction: at least one point, x strictly increasing, all values finite.
Evaluation is a binary search, O(log n); profiles hold tens of points.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fineslab.errors import ConfigError


@dataclass(frozen=True)
class PiecewiseLinear:
    """y(x) through the points `xs`, `ys`, linear between them and linearly extended outside."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.xs or len(self.xs) != len(self.ys):
            raise ConfigError(f"a curve needs matching, non-empty x and y lists, got {self.xs!r}")
        if not all(math.isfinite(v) for v in (*self.xs, *self.ys)):
            raise ConfigError(f"a curve holds a non-finite value: {self.xs!r} {self.ys!r}")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise ConfigError(f"curve x values must be strictly increasing, got {self.xs!r}")

    @classmethod
    def from_points(cls, points: Sequence[Sequence[float]]) -> PiecewiseLinear:
        return cls(tuple(float(p[0]) for p in points), tuple(float(p[1]) for p in points))

    def points(self) -> list[list[float]]:
        return [[x, y] for x, y in zip(self.xs, self.ys, strict=True)]

    def is_non_decreasing(self) -> bool:
        return all(b >= a for a, b in zip(self.ys, self.ys[1:], strict=False))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        i = bisect.bisect_right(xs, x)
        i = min(max(i, 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def upper_concave_hull(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[float, float]]:
    """The smallest concave curve above the points (Andrew's monotone chain, upper half).

    Water-filling is optimal only on concave curves (non-increasing slopes); a measured MME
    curve can have bumps, and the hull is what a greedy allocator can actually achieve by
    skipping over a bump in one step.
    """
    hull: list[tuple[float, float]] = []
    for x, y in zip(xs, ys, strict=True):
        while len(hull) >= 2:
            (xa, ya), (xb, yb) = hull[-2], hull[-1]
            # Drop b when it lies on or below the chord a -> (x, y).
            if (yb - ya) * (x - xa) <= (y - ya) * (xb - xa):
                hull.pop()
            else:
                break
        hull.append((x, y))
    return hull

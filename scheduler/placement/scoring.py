"""MME of a placed replica and the two GPU scores of Algorithm 1 (paper equations 1-3).

A replica m's MME curve g_m(K) is its generated tokens/s with a KV pool of K bytes (the
profile's `mme` table, flat beyond its last point: a bigger pool than the largest profiled
batch needs buys nothing). Its base KV K0_m is already charged in F_m, so contested memory buys
g_m(K0_m + dK) - g_m(K0_m).

    mu_m(G') = slope of g_m just above K0_m (on its upper concave hull): the extra tokens/s a
               small increment of KV buys, the paper's definition; G' enters through the
               device the profile is for
    proxy  (eq 3): score = (1 / |G'|) * sum_m mu_m(G') * K_rem(G')
    exact (eq 1-2): score = max sum_m [g_m(K0_m + dK_m) - g_m(K0_m)]  s.t.  sum_m dK_m <= K_rem

With constant mu_m the exact problem is a linear program whose optimum puts all of K_rem on the
largest mu_m; with curves it is a concave knapsack, solved exactly by water-filling: cut each
curve's upper concave hull (from K0_m on) into segments, take segments in decreasing slope until
K_rem is spent. Cost O(S log S) for S segments in G'.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fineslab.scheduler.curves import PiecewiseLinear, upper_concave_hull


@dataclass(frozen=True)
class Resident:
    """A placed (or candidate) replica as the scorers see it."""

    key: str
    model: str
    tp: int
    fixed_bytes: int  # per rank
    kv_base_bytes: float  # whole replica (all ranks), the start of its MME curve
    mme: PiecewiseLinear
    rate_weight: float = 0.0  # KVPR's SLO-weighted token rate
    segments: tuple[tuple[float, float], ...] = field(init=False)  # (slope, length) desc

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", self._hull_segments())

    def _hull_segments(self) -> tuple[tuple[float, float], ...]:
        start = (self.kv_base_bytes, self.tokens_per_s(self.kv_base_bytes))
        later = [(x, y) for x, y in zip(self.mme.xs, self.mme.ys, strict=True)
                 if x > self.kv_base_bytes]
        points = [start, *later]
        hull = upper_concave_hull([p[0] for p in points], [p[1] for p in points])
        return tuple(((y1 - y0) / (x1 - x0), x1 - x0)
                     for (x0, y0), (x1, y1) in itertools.pairwise(hull)
                     if y1 > y0)

    def tokens_per_s(self, kv_bytes: float) -> float:
        return self.mme(min(kv_bytes, self.mme.xs[-1]))

    def slowed(self, slowdown: float) -> Resident:
        """The replica running `slowdown` times slower (co-location): every tokens/s of its
        MME curve, hence every slope, divided by it."""
        if slowdown == 1.0:
            return self
        curve = PiecewiseLinear(self.mme.xs, tuple(y / slowdown for y in self.mme.ys))
        return replace(self, mme=curve)

    @property
    def mu(self) -> float:
        """Marginal memory efficiency at the base KV: tokens/s per extra KV byte."""
        return self.segments[0][0] if self.segments else 0.0


def proxy_score(members: Sequence[Resident], k_rem_bytes: float) -> float:
    """Equation 3."""
    return sum(m.mu for m in members) * k_rem_bytes / len(members)


def water_fill(members: Sequence[Resident], budget_bytes: float,
               rank_scale: bool = False) -> tuple[float, dict[str, float]]:
    """Equations 1-2: the best total tokens/s gain and each member's extra bytes.

    With `rank_scale` the budget is one GPU's bytes and a TP-t member is seen through its
    per-rank curve g(t * x) / t (a segment of L replica bytes becomes L / t rank bytes at the
    same slope, and the gain is the rank's share of the tokens): used to split one GPU.
    """
    pieces = sorted(((slope, length / (m.tp if rank_scale else 1), m.key)
                     for m in members for slope, length in m.segments), reverse=True)
    gain, left = 0.0, max(0.0, budget_bytes)
    alloc = {m.key: 0.0 for m in members}
    for slope, length, key in pieces:
        if left <= 0:
            break
        take = min(length, left)
        alloc[key] += take
        gain += slope * take
        left -= take
    return gain, alloc


def exact_score(members: Sequence[Resident], k_rem_bytes: float) -> float:
    return water_fill(members, k_rem_bytes)[0]

"""SwiftCache lending, live (paper 003, Algorithm 1): how much a lender keeps, what a borrower gets.

A lender (a model serving its own requests) holds an allocation N of its KV capacity K; the
rest, K - N, may be lent to a borrower. Algorithm 1 grows N at once when the lender's own
demand outgrows it, and shrinks it at each check to the largest demand of the last window, in
whole elastic units. The launcher feeds one `ElasticAllocation` per lender per device a demand
sample every ~0.5 s and lends what `lend_budget` allows. Pure policy: no torch, no SGLang; the
slabs themselves move elsewhere. The simulator's offline version (`fineslab/sim/lenders.py`,
`elastic_offers`) shares `scale_up` and `scale_down` with this module.

Glossary (one lender on one device; integer units, slabs in the launcher):

    K         `capacity`: the lender's KV capacity
    D(t)      `demand`: its own use at time t (clamped to K); a sample is in force until the next
    N(t)      `alloc`: its allocation by Algorithm 1, N(first sample) = K
    MEU       `meu`: the minimum elastic unit, the step of every change of N
    w, c      `window_s`, `check_s`: the scale-down window and the check period, seconds
    headroom  N - D: what the lender keeps reserved beyond its use now (its typical burst)

Rules:

    up        at every sample: N = min(K, N + ScaleUp(N, D)), a multiple of MEU at once
    down      at the first sample at least c after the previous check (the first check at c
              after the first sample): N -= ScaleDown(N, max D over (t - w, t]), counting the
              sample in force at t - w (as `elastic_offers` does)

Invariants (after every `observe`):

    0 <= min(D, K) <= N <= K        (K - N) % MEU == 0     (N starts at K; steps are MEUs)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fineslab.scheduler.reclaim import ReclaimConfig

from fineslab.errors import ConfigError


def scale_up(alloc: int, need: int, meu: int) -> int:
    """Algorithm 1, SCALEUP: what to add (a multiple of MEU) so that `need` fits `alloc`.

    The smallest such multiple, so it may overshoot `need` by up to MEU - 1; 0 when it fits."""
    return 0 if need <= alloc else math.ceil((need - alloc) / meu) * meu


def scale_down(alloc: int, max_need: int, meu: int) -> int:
    """Algorithm 1, SCALEDOWN: what to release (a multiple of MEU) down to `max_need`.

    The floor of the excess in MEUs, so `alloc` never drops below `max_need`; 0 when none."""
    return 0 if max_need >= alloc else (alloc - max_need) // meu * meu


class ElasticAllocation:
    """Algorithm 1 for one lender, fed demand samples as they come (module docstring, "Rules").

    Memory is bounded by the window: only the samples in force during (t - w, t] are kept.
    Bad arguments, a negative demand and time going backwards raise `ConfigError` (a
    `ValueError`): each is a defect of the caller, never a transient state.
    """

    def __init__(self, capacity: int, meu: int, window_s: float, check_s: float) -> None:
        if capacity < 0 or meu <= 0:
            raise ConfigError(f"elastic allocation: capacity {capacity} must be >= 0 and "
                              f"meu {meu} > 0")
        if window_s < 0 or check_s <= 0:
            raise ConfigError(f"elastic allocation: window_s {window_s} must be >= 0 and "
                              f"check_s {check_s} > 0")
        self.capacity, self.meu = capacity, meu
        self.window_s, self.check_s = window_s, check_s
        self._alloc = capacity
        self._samples: deque[tuple[float, int]] = deque()  # (time, clamped demand), ascending
        self._last_check_s: float | None = None  # the first sample's time until a check

    @property
    def alloc(self) -> int:
        """N: the lender's allocation now."""
        return self._alloc

    def headroom(self, demand: int) -> int:
        """N - D, at least 0: what the lender keeps reserved beyond its use `demand`."""
        return max(0, self._alloc - demand)

    def observe(self, now: float, demand: int) -> int:
        """Record D(now) = `demand`, scale up at once, scale down if a check is due; return N."""
        if demand < 0:
            raise ConfigError(f"elastic allocation: demand {demand} must be >= 0")
        if self._samples and now < self._samples[-1][0]:
            raise ConfigError(f"elastic allocation: time went back from "
                              f"{self._samples[-1][0]} s to {now} s")
        demand = min(demand, self.capacity)
        self._samples.append((now, demand))
        self._forget_before(now - self.window_s)
        self._alloc = min(self.capacity, self._alloc + scale_up(self._alloc, demand, self.meu))
        if self._last_check_s is None:
            self._last_check_s = now
        elif now - self._last_check_s >= self.check_s:
            self._last_check_s = now
            window_max = max(d for _, d in self._samples)
            self._alloc -= scale_down(self._alloc, window_max, self.meu)
        return self._alloc

    def _forget_before(self, start_s: float) -> None:
        """Drop the samples no longer in force at `start_s` (one after it is in force there or
        later); times only grow, so no later window needs them."""
        while len(self._samples) >= 2 and self._samples[1][0] <= start_s:
            self._samples.popleft()


def lend_budget(free: int, headrooms: Sequence[int], lent: int, cap: int,
                low_water: int = 0) -> int:
    """The slabs a borrower may hold lent right now on one device.

        budget = max(0, min(cap, lent + free - sum(headrooms) - low_water))

    `free`: the arena's free slabs, not counting the borrower's lent ones (`lent`, which it
    may keep); `headrooms`: each lender's N_i - D_i (`ElasticAllocation.headroom`); `cap`:
    the per-borrower cap; `low_water`: slabs always left free besides.

    Why the headroom: Algorithm 1 keeps N_i above a lender's use by its largest demand of the
    window, so leaving N_i - D_i free lets its typical bursts land on free slabs instead of
    dropping lent pages. It is a courtesy, not a guarantee: a lender never waits either way,
    since a lender's allocation takes lent slabs back at once (the borrower loses those pages).
    A budget below `lent` means the borrower should give back the difference.
    """
    if min(free, lent, cap, low_water, *headrooms) < 0:
        raise ConfigError(f"lend budget: negative input (free {free}, lent {lent}, cap {cap}, "
                          f"low_water {low_water}, headrooms {list(headrooms)})")
    return max(0, min(cap, lent + free - sum(headrooms) - low_water))


@dataclass(frozen=True)
class BorrowerTerms:
    """A borrower's lending terms (its model's `prefix_lending:`): a cap as a fraction of the
    arena's slabs, and the lenders' scale-down window and check period it asks for."""

    runtime_id: str
    cap: float
    window_s: float
    check_s: float


@dataclass(frozen=True)
class LendingUse:
    """One device's arena as the lending policy sees it: every runtime there, its slabs, what
    each live runtime holds, and what each borrower holds lent."""

    device: str
    runtime_ids: Sequence[str]
    num_slabs: int
    free_slabs: int
    held: Mapping[str, int]
    lent: Mapping[str, int]


@dataclass(frozen=True)
class LendCaps:
    """Each borrower's cap (slabs it may hold lent) on one device, and why."""

    device: str
    caps: Mapping[str, int]
    reason: str


class PrefixLendPolicy:
    """SwiftCache's lending on each device (Algorithm 1 per lender, `lend_budget` per borrower):

        lenders   every runtime on the device that is not a borrower; each has an
                  `ElasticAllocation` over its demand D_i = slabs it holds now, K_i = the
                  arena's slabs, an elastic unit of one slab
        budget    per borrower: lend_budget(free unlent slabs / borrowers, the lenders'
                  headrooms, its lent slabs, cap x arena slabs, low water), so the borrowers of
                  a device split what the lenders do not keep

    `low_free_fraction`: the slabs always left free (by default the cache reclaimer's
    low-water mark, `ReclaimConfig`).
    Snapshot in, caps out; the lenders' allocations are the policy's memory."""

    def __init__(self, borrowers: Sequence[BorrowerTerms],
                 low_free_fraction: float = ReclaimConfig().low_free_fraction) -> None:
        self.borrowers = {b.runtime_id: b for b in borrowers}
        self.low_free_fraction = low_free_fraction
        self._lenders: dict[str, ElasticAllocation] = {}

    def decide(self, use: LendingUse, now_s: float) -> LendCaps | None:
        """The caps of the device's borrowers; None when it has none."""
        mine = [self.borrowers[r] for r in use.runtime_ids if r in self.borrowers]
        if not mine:
            return None
        headrooms = []
        for runtime_id in use.runtime_ids:
            if runtime_id in self.borrowers or runtime_id not in use.held:
                continue
            lender = self._lenders.setdefault(runtime_id, ElasticAllocation(
                use.num_slabs, 1, max(b.window_s for b in mine), min(b.check_s for b in mine)))
            lender.observe(now_s, use.held[runtime_id])
            headrooms.append(lender.headroom(use.held[runtime_id]))
        free_unlent = max(0, use.free_slabs - sum(use.lent.values()))
        low_water = int(self.low_free_fraction * use.num_slabs)
        caps = {b.runtime_id: lend_budget(free_unlent // len(mine), headrooms,
                                          use.lent.get(b.runtime_id, 0),
                                          int(b.cap * use.num_slabs), low_water)
                for b in mine}
        return LendCaps(use.device, caps, f"free {free_unlent} unlent slab(s), lenders' "
                                          f"headroom {sum(headrooms)}, low water {low_water}")

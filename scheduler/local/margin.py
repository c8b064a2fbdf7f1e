"""A drop margin learned from admitted requests' first tokens, and the peer policies that drop
by the prediction it corrects (issue #38).

Live, the paper's policy lost capacity mostly by drops: its TTFT predictor (the profile scaled
by timed steps) over-shot on the CPU fleet, so requests were refused "even alone" that would
have met their deadline. The margin measures that over-shoot on the requests it let through:

    predicted_s   the TTFT the caller's predictor gave an admitted request, from the decision
                  that admitted it: the prefill of everything ahead of it (work already under
                  way, the batch before it) and of its own prompt
    real_s        from that decision to its first token, as the caller saw it
    ratio r       real_s / predicted_s; below 1 the predictor over-shot

`DropMargin` keeps the last `window` ratios with the time each was seen. Each fades towards 1
with its age, its log halving every `half_life_s` (as the step scales of
`fineslab.scheduler.refreshed` fade, and for the same reason: a margin learned in a quiet minute
must not outlive it), and the correction is a high quantile of the faded ratios, clamped:

    c = 1                                                 below `min_samples` ratios
    c = min(1, max(floor, Q_q(r_i ** 0.5 ** (age_i / half_life_s))))     otherwise

Q_q is the nearest-rank quantile (an observed value, never interpolated below one): a share q
of recently admitted requests had their first token within c x their prediction, so a request
kept because c x its prediction meets its deadline is late about 1 - q of the time, if the
predictor errs as it did lately. c <= 1: a predictor that under-shoots is left as it is (the
drops stay the paper's), the margin never drops more; `floor` bounds what a run of cached
prefixes (ratios near 0) can teach it.

`MarginBatchPolicy` runs a policy of this package (Algorithm 2 as `adaptive-margin`, its early
shed as `adaptive-early-shed-margin`) on the predictor times c: the whole policy, not only its
drop test. Algorithm 2's admission test (t + TTFT(S) < d_front(S)) reads the same predictor;
with only the drop test corrected, a request the margin keeps would fail the admission test
alone, be deferred at every decision and dropped at its deadline, never served. With c = 1 it
decides exactly as the policy it wraps; over `adaptive` it drops a subset of what Algorithm 2
drops (its drop test is now + c x TTFT({r}) >= d_r).

Who feeds it: whoever sees first tokens, through `margin_of(policy).observe`: the engine policy
(`fineslab.sglang_plugin.engine_policy`) and the router's queues (streamed requests). Nothing
feeds it in the simulator (its predictor is exact): there the peers decide as those they wrap.
Cost: `observe` O(1); `correction` O(window log window) per decision (tens of microseconds).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fineslab.scheduler.local.base import BatchDecision, BatchPolicy, QueueSnapshot, TtftPredictor
from fineslab.scheduler.refreshed import HALF_LIFE_S

from fineslab.errors import ConfigError

#: The suffix of a margin peer's name: `adaptive` -> `adaptive-margin`.
MARGIN_SUFFIX = "-margin"


@dataclass(frozen=True)
class MarginConfig:
    #: How many of the latest ratios the quantile is taken over.
    window: int = 64
    #: The quantile q (module doc): the share of admitted requests c x prediction covered.
    quantile: float = 0.95
    #: Ratios needed before the margin acts (until then c = 1, the wrapped policy's drops).
    min_samples: int = 16
    #: The least c: predictions are never cut below this share.
    floor: float = 0.25
    #: A ratio this old counts half (its log halves).
    half_life_s: float = HALF_LIFE_S

    def __post_init__(self) -> None:
        if not (self.window >= 1 and 1 <= self.min_samples <= self.window
                and 0 < self.quantile <= 1 and 0 < self.floor <= 1 and self.half_life_s > 0):
            raise ConfigError(f"a drop margin needs window >= min_samples >= 1, 0 < quantile "
                              f"<= 1, 0 < floor <= 1 and half_life_s > 0; got {self}")


class DropMargin:
    """The learned correction of a TTFT predictor (module doc). Times are the caller's clock,
    one clock for `observe` and `correction` alike."""

    def __init__(self, config: MarginConfig | None = None) -> None:
        self.config = config or MarginConfig()
        self._ratios: deque[tuple[float, float]] = deque(maxlen=self.config.window)

    @property
    def samples(self) -> int:
        """The ratios held (at most `window`)."""
        return len(self._ratios)

    def observe(self, predicted_s: float, real_s: float, now_s: float) -> bool:
        """One admitted request's first token came `real_s` after the decision that predicted
        `predicted_s`; False (ignored) unless predicted_s > 0 and real_s >= 0, both finite."""
        if not (math.isfinite(predicted_s) and math.isfinite(real_s) and math.isfinite(now_s)
                and predicted_s > 0 and real_s >= 0):
            return False
        self._ratios.append((real_s / predicted_s, now_s))
        return True

    def correction(self, now_s: float) -> float:
        """c at `now_s`: the factor every prediction is multiplied by (module doc)."""
        config = self.config
        if len(self._ratios) < config.min_samples:
            return 1.0
        faded = sorted(_faded(ratio, now_s - seen_s, config.half_life_s)
                       for ratio, seen_s in self._ratios)
        rank = max(1, math.ceil(config.quantile * len(faded)))
        return min(1.0, max(config.floor, faded[rank - 1]))


def _faded(ratio: float, age_s: float, half_life_s: float) -> float:
    """`ratio` with its log halved for every `half_life_s` of `age_s` (a ratio of 0 fades
    from 1e-9: 0 to any power would stay 0)."""
    if age_s <= 0:
        return ratio
    return max(ratio, 1e-9) ** (0.5 ** (age_s / half_life_s))


@dataclass(frozen=True)
class CorrectedPredictor:
    """`base` times `factor` (monotone in the batch as `base` is, for factor > 0)."""

    base: TtftPredictor
    factor: float

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.factor * self.base.ttft_s(prompt_tokens)


class MarginBatchPolicy:
    """`inner` deciding on its predictor times the learned correction (module doc); the
    decision's `predicted_finish_s` and drop reasons are the corrected predictor's."""

    def __init__(self, inner: BatchPolicy, margin: DropMargin | None = None) -> None:
        self.inner = inner
        self.name = inner.name + MARGIN_SUFFIX
        self.margin = margin or DropMargin()

    def decide(self, snapshot: QueueSnapshot, predictor: TtftPredictor) -> BatchDecision:
        factor = self.margin.correction(snapshot.now_s)
        if factor >= 1.0:
            return self.inner.decide(snapshot, predictor)
        return self.inner.decide(snapshot, CorrectedPredictor(predictor, factor))


def margin_of(policy: BatchPolicy) -> DropMargin | None:
    """The margin a policy learns with, for the caller that sees first tokens to feed; None
    for the policies that learn nothing."""
    return policy.margin if isinstance(policy, MarginBatchPolicy) else None

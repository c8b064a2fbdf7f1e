"""The engine policy's TTFT predictor, refreshed from the prefill steps this runtime runs.

The profile the engine schedule carries was measured once, elsewhere (in-process or through
HTTP, on an idle machine or not), so it is wrong in two ways the engine can see:

    its level       the machine's speed changes under other load, and a profile measured
                    through HTTP charges a request's fixed cost (HTTP, tokenizer) to every step
    its shape       that fixed cost weighs most on small steps

`RefreshedPredictor` keeps the profile's curve and scales it by what this runtime's own prefill
steps take now. A step is timed in the scheduler loop itself: from the moment SGLang's batch
former returns a prefill batch of n new tokens to its next call, one loop iteration later (run,
process the result, take in new requests: what a queued request waits for). Per power-of-two
bucket of n (and over all steps), the scale is an exponentially weighted mean of
log(measured / profiled), so one outlier step (a page fault, a GC pause) moves it by a bounded
factor; a bucket with fewer than `MIN_SAMPLES` steps uses the all-steps scale. A step whose
sample ratio falls outside [1/MAX_RATIO, MAX_RATIO] is clamped, and the scale itself stays
within the same bounds.

Only prefill steps are timed: with mixed chunked prefill off (SGLang's default) a loop
iteration runs either one prefill batch or one decode batch, and SGLang prefers the prefill,
so a queued request's TTFT is the prefill steps ahead of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from fineslab.scheduler.predictors import ChunkedPrefillPredictor, chunked_prefill_s

logger = logging.getLogger(__name__)

#: Weight of the newest step in the exponentially weighted mean of log ratios.
ALPHA = 0.2
#: A bucket's own scale is used once it has seen this many steps.
MIN_SAMPLES = 3
#: Bound on one step's measured / profiled ratio and on the scale.
MAX_RATIO = 64.0
#: The scale is logged when it has moved by this factor since it was last logged.
LOG_FACTOR = 1.25


def bucket_of(tokens: int) -> int:
    """The power-of-two bucket of a step of `tokens` new tokens (1 -> 0, 2-3 -> 1, ...)."""
    return max(0, int(tokens).bit_length() - 1)


@dataclass
class _Mean:
    """An exponentially weighted mean of log ratios, and how many steps fed it."""

    log_scale: float = 0.0
    samples: int = 0

    def add(self, log_ratio: float) -> None:
        weight = ALPHA if self.samples else 1.0
        self.log_scale += weight * (log_ratio - self.log_scale)
        self.samples += 1


@dataclass
class RefreshedPredictor:
    """A `ChunkedPrefillPredictor` whose step times are scaled by measured steps (module
    docstring); same `prefill_tokens_s` / `ttft_s` as the base, so the policies take it."""

    base: ChunkedPrefillPredictor
    overall: _Mean = field(default_factory=_Mean)
    buckets: dict[int, _Mean] = field(default_factory=dict)
    _logged_log_scale: float = 0.0
    #: _floors[b]: the longest scaled step of any bucket below b + 1 (see `step_s`).
    _floors: list[float] = field(default_factory=list)

    @property
    def chunk_tokens(self) -> int:
        return self.base.chunk_tokens

    def scale(self, tokens: int) -> float:
        """The factor applied to the profiled time of a step of `tokens` new tokens."""
        mean = self.buckets.get(bucket_of(tokens))
        chosen = mean if mean is not None and mean.samples >= MIN_SAMPLES else self.overall
        return math.exp(chosen.log_scale)

    def _scaled(self, tokens: int) -> float:
        return self.scale(tokens) * self.base.prefill_s(tokens)

    def step_s(self, tokens: int) -> float:
        """One prefill step of `tokens` new tokens, as this runtime runs it now: the scaled
        profile, and never less than the longest scaled step of fewer tokens (bucket scales
        differ, and Algorithm 2 relies on a TTFT that never shrinks as tokens are added)."""
        if tokens <= 0:
            return 0.0
        bucket = bucket_of(tokens)
        floor = self._floors[bucket - 1] if 0 < bucket <= len(self._floors) else 0.0
        return max(self._scaled(tokens), floor)

    def _refloor(self) -> None:
        """Recompute `_floors` after the scales moved: the running maximum of each bucket's
        longest scaled step (its top, 2^(b+1) - 1 tokens), up to the chunk's bucket."""
        floors, longest = [], 0.0
        for bucket in range(bucket_of(self.chunk_tokens)):
            longest = max(longest, self._scaled(2 ** (bucket + 1) - 1))
            floors.append(longest)
        self._floors = floors

    def prefill_tokens_s(self, total_tokens: int) -> float:
        return chunked_prefill_s(total_tokens, self.chunk_tokens, self.step_s)

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.prefill_tokens_s(sum(prompt_tokens))

    def observe(self, tokens: int, seconds: float) -> None:
        """One measured prefill step; ignored when either side is not a positive time."""
        profiled = self.base.prefill_s(tokens) if tokens > 0 else 0.0
        if not (profiled > 0 and math.isfinite(seconds) and seconds > 0):
            return
        bound = math.log(MAX_RATIO)
        log_ratio = min(bound, max(-bound, math.log(seconds / profiled)))
        self.overall.add(log_ratio)
        self.buckets.setdefault(bucket_of(tokens), _Mean()).add(log_ratio)
        self._refloor()
        if abs(self.overall.log_scale - self._logged_log_scale) >= math.log(LOG_FACTOR):
            self._logged_log_scale = self.overall.log_scale
            logger.info("fineslab engine scheduler: prefill steps run at %.2fx the profile "
                        "(%d steps timed; last %d tokens in %.1f ms)",
                        math.exp(self.overall.log_scale), self.overall.samples, tokens,
                        seconds * 1e3)


@dataclass
class StepClock:
    """Times the prefill step that follows each batch-former call (module docstring).

    `forward_ct` is SGLang's count of batches run: a sample counts only when exactly one batch
    ran between the call that formed the prefill and the next call (with SGLang's
    prefill-decode interval set, decode steps can run in between; those gaps are not a step)."""

    predictor: RefreshedPredictor
    _pending: tuple[int, int, float] | None = None  # (new tokens, forward_ct, formed at)

    def loop_came_back(self, forward_ct: int, now_s: float) -> None:
        """The batch former is called again: the step formed last call (if any) is over."""
        if self._pending is not None:
            tokens, formed_ct, formed_s = self._pending
            self._pending = None
            if forward_ct == formed_ct + 1:
                self.predictor.observe(tokens, now_s - formed_s)

    def batch_formed(self, batch: object, forward_ct: int, now_s: float) -> None:
        """SGLang's batch former returned `batch` (None: no prefill this iteration)."""
        tokens = getattr(batch, "extend_num_tokens", None) if batch is not None else None
        if isinstance(tokens, int) and tokens > 0:
            self._pending = (tokens, forward_ct, now_s)

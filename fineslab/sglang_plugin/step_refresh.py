"""Timing a runtime's prefill steps for the engine policy's refreshed predictor.

The predictor itself (`RefreshedPredictor`, the scales, their file for the router's gate) is
`fineslab.scheduler.refreshed`, shared with the router; this module times the steps. A step is
timed in the scheduler loop itself: from the moment SGLang's batch former returns a prefill
batch of n new tokens to its next call, one loop iteration later (run, process the result,
take in new requests: what a queued request waits for).

Only prefill steps are timed: with mixed chunked prefill off (SGLang's default) a loop
iteration runs either one prefill batch or one decode batch, and SGLang prefers the prefill,
so a queued request's TTFT is the prefill steps ahead of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineslab.scheduler.refreshed import (
    ALPHA,
    LOG_FACTOR,
    MAX_RATIO,
    MIN_SAMPLES,
    RefreshedPredictor,
    bucket_of,
)

__all__ = ["ALPHA", "LOG_FACTOR", "MAX_RATIO", "MIN_SAMPLES", "RefreshedPredictor", "StepClock",
           "bucket_of"]


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

"""Local scheduler: per-model batch policies chosen by name.

    policy = get_batch_policy("adaptive")      # or "adaptive-early-shed", "fcfs", "moore-hodgson"
    decision = policy.decide(QueueSnapshot(...), ChunkedPrefillPredictor.from_profile(p))

The `-margin` peers (`adaptive-margin`, `adaptive-early-shed-margin`) decide as the policy they
name on a prediction corrected by a margin learned from first tokens (margin.py); a caller that
sees first tokens feeds `margin_of(policy)`.
"""

from __future__ import annotations

from collections.abc import Callable

from fineslab.scheduler.local.adaptive import AdaptiveBatchPolicy
from fineslab.scheduler.local.base import (
    ENGINE_DROP_PREFIX,
    BatchDecision,
    BatchLimits,
    BatchPolicy,
    DroppedRequest,
    QueueSnapshot,
    TtftPredictor,
    WaitingRequest,
)
from fineslab.scheduler.local.baselines import FcfsBatchPolicy, MooreHodgsonBatchPolicy
from fineslab.scheduler.local.early_shed import EarlyShedBatchPolicy
from fineslab.scheduler.local.margin import (
    MARGIN_SUFFIX,
    DropMargin,
    MarginBatchPolicy,
    MarginConfig,
    margin_of,
)

from fineslab.errors import ConfigError

BATCH_POLICIES: dict[str, Callable[[], BatchPolicy]] = {
    AdaptiveBatchPolicy.name: AdaptiveBatchPolicy,
    EarlyShedBatchPolicy.name: EarlyShedBatchPolicy,
    FcfsBatchPolicy.name: FcfsBatchPolicy,
    MooreHodgsonBatchPolicy.name: MooreHodgsonBatchPolicy,
    AdaptiveBatchPolicy.name + MARGIN_SUFFIX: lambda: MarginBatchPolicy(AdaptiveBatchPolicy()),
    EarlyShedBatchPolicy.name + MARGIN_SUFFIX: lambda: MarginBatchPolicy(EarlyShedBatchPolicy()),
}


def get_batch_policy(name: str) -> BatchPolicy:
    try:
        return BATCH_POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown batch policy {name!r}; known: {sorted(BATCH_POLICIES)}") \
            from None


__all__ = [
    "BATCH_POLICIES", "ENGINE_DROP_PREFIX", "AdaptiveBatchPolicy", "BatchDecision",
    "BatchLimits", "BatchPolicy", "DropMargin", "DroppedRequest", "EarlyShedBatchPolicy",
    "FcfsBatchPolicy", "MarginBatchPolicy", "MarginConfig", "MooreHodgsonBatchPolicy",
    "QueueSnapshot", "TtftPredictor", "WaitingRequest", "get_batch_policy", "margin_of",
]

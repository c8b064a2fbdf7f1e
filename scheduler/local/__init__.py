"""Local scheduler: per-model batch policies chosen by name.

    policy = get_batch_policy("adaptive")      # or "adaptive-early-shed", "fcfs", "moore-hodgson"
    decision = policy.decide(QueueSnapshot(...), ChunkedPrefillPredictor.from_profile(p))
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

from fineslab.errors import ConfigError

BATCH_POLICIES: dict[str, Callable[[], BatchPolicy]] = {
    AdaptiveBatchPolicy.name: AdaptiveBatchPolicy,
    EarlyShedBatchPolicy.name: EarlyShedBatchPolicy,
    FcfsBatchPolicy.name: FcfsBatchPolicy,
    MooreHodgsonBatchPolicy.name: MooreHodgsonBatchPolicy,
}


def get_batch_policy(name: str) -> BatchPolicy:
    try:
        return BATCH_POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown batch policy {name!r}; known: {sorted(BATCH_POLICIES)}") \
            from None


__all__ = [
    "BATCH_POLICIES", "ENGINE_DROP_PREFIX", "AdaptiveBatchPolicy", "BatchDecision",
    "BatchLimits", "BatchPolicy", "DroppedRequest", "EarlyShedBatchPolicy", "FcfsBatchPolicy",
    "MooreHodgsonBatchPolicy",
    "QueueSnapshot", "TtftPredictor", "WaitingRequest", "get_batch_policy",
]

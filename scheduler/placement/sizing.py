"""Sizing a model before placement: its operating point, F_M, DP replicas, candidate groups.

F_M is charged at the smallest profiled batch size b whose throughput meets the per-replica
rate (paper section 6.2):

    capacity(b) = throughput_tokens_per_s(b) / output_tokens          requests/s
    TTFT(b)     = chunked-prefill TTFT of b prompts arriving together
    F_M         = weights + activation(b) + b * mean_context * kv_token_bytes   (per rank)

If that b breaks the TTFT SLO, the rate is split over DP = 2, 3, ... replicas (each an
independent instance) until some replica size meets both; `PlacementInfeasible` says why none
does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fineslab.scheduler.placement.base import GpuSpec, ModelDemand, OperatingPoint
from fineslab.scheduler.predictors import ChunkedPrefillPredictor, request_rate_capacity_per_s

from fineslab.errors import PlacementInfeasible


def candidate_groups(gpus: Sequence[GpuSpec], tp: int, device: str) -> list[tuple[int, ...]]:
    """Aligned groups of `tp` consecutive GPUs of `device` (a single GPU when tp == 1)."""
    same = [g.gpu_id for g in gpus if g.device == device]
    return [tuple(same[i:i + tp]) for i in range(0, len(same) - tp + 1, tp)]


def size_model(demand: ModelDemand, max_replicas: int) -> OperatingPoint:
    """The operating point (batch size, DP degree) whose F_M the placer charges."""
    profile = demand.profile
    predictor = ChunkedPrefillPredictor.from_profile(profile)
    prompt_tokens = profile.workload.prompt_tokens
    if predictor.ttft_s([prompt_tokens]) > demand.ttft_slo_s:
        raise PlacementInfeasible(
            f"no SLO-feasible operating point: one {prompt_tokens}-token prompt takes "
            f"{predictor.ttft_s([prompt_tokens]):.3f} s > TTFT SLO {demand.ttft_slo_s} s")
    batch_sizes = [int(b) for b in profile.throughput_tokens_per_s.xs]
    for num_replicas in range(1, max(1, max_replicas) + 1):
        rate_s = demand.request_rate_per_s / num_replicas
        output_tokens = profile.workload.output_tokens
        meets_rate = [b for b in batch_sizes
                      if request_rate_capacity_per_s(profile, b, output_tokens) >= rate_s]
        if not meets_rate:
            continue
        batch_size = meets_rate[0]
        ttft_s = predictor.ttft_s([prompt_tokens] * batch_size)
        if ttft_s <= demand.ttft_slo_s:
            return OperatingPoint(
                batch_size=batch_size, num_replicas=num_replicas, rate_per_replica_s=rate_s,
                ttft_s=ttft_s, weights_bytes=profile.weights_bytes,
                activation_bytes=int(profile.activation_bytes(batch_size)),
                kv_base_bytes=math.ceil(batch_size * profile.workload.mean_context_tokens
                                        * profile.kv_token_bytes))
    raise PlacementInfeasible(
        f"rate {demand.request_rate_per_s}/s within TTFT SLO {demand.ttft_slo_s} s needs more "
        f"than {max_replicas} replicas (the number of candidate GPU groups)")

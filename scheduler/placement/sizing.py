"""Sizing a model before placement: its operating point, F_M, DP replicas, candidate groups.

F_M is charged at the smallest profiled batch size b whose throughput meets the per-replica
rate (paper section 6.2):

    capacity(b) = throughput_tokens_per_s(b) / output_tokens          requests/s
    TTFT(b)     = chunked-prefill TTFT of b prompts arriving together
    F_M         = weights + activation(b) + b * mean_context * kv_token_bytes   (per rank)

If that b breaks the TTFT SLO, the rate is split over DP = 2, 3, ... replicas (each an
independent instance) until some replica size meets both.

The paper stops there; a fleet may not hold what that asks for. `operating_ladder` lists the
points a placer may fall back to, best first (`degrade` walks it):

    rung 0          the paper's point (or, when no DP degree up to the number of candidate
                    groups meets rate and SLO, that many replicas at the best batch they have)
    rung k          n - k replicas, each sized for rate / (n - k)       (meets_slo may be False)
    last rung       one replica at the smallest profiled batch: weights + activations + the
                    least KV, the smallest footprint the model can run with

Only a model with no group of its device, or whose single mean prompt already breaks its TTFT
SLO, has no ladder (`PlacementInfeasible`).
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


def _check_slo_feasible(demand: ModelDemand) -> None:
    profile = demand.profile
    prompt_tokens = profile.workload.prompt_tokens
    ttft_s = ChunkedPrefillPredictor.from_profile(profile).ttft_s([prompt_tokens])
    if ttft_s > demand.ttft_slo_s:
        raise PlacementInfeasible(
            f"no SLO-feasible operating point: one {prompt_tokens}-token prompt takes "
            f"{ttft_s:.3f} s > TTFT SLO {demand.ttft_slo_s} s")


def _point(demand: ModelDemand, num_replicas: int, batch_size: int) -> OperatingPoint:
    profile = demand.profile
    predictor = ChunkedPrefillPredictor.from_profile(profile)
    rate_s = demand.request_rate_per_s / num_replicas
    ttft_s = predictor.ttft_s([profile.workload.prompt_tokens] * batch_size)
    capacity = request_rate_capacity_per_s(profile, batch_size, profile.workload.output_tokens)
    return OperatingPoint(
        batch_size=batch_size, num_replicas=num_replicas, rate_per_replica_s=rate_s,
        ttft_s=ttft_s, weights_bytes=profile.weights_bytes,
        activation_bytes=int(profile.activation_bytes(batch_size)),
        kv_base_bytes=math.ceil(batch_size * profile.workload.mean_context_tokens
                                * profile.kv_token_bytes),
        meets_slo=capacity >= rate_s and ttft_s <= demand.ttft_slo_s)


def point_for(demand: ModelDemand, num_replicas: int) -> OperatingPoint:
    """`num_replicas` replicas at the smallest batch meeting rate / num_replicas (the largest
    profiled batch when none does); `meets_slo` says whether its TTFT is within the SLO."""
    profile = demand.profile
    output_tokens = profile.workload.output_tokens
    rate_s = demand.request_rate_per_s / num_replicas
    batch_sizes = [int(b) for b in profile.throughput_tokens_per_s.xs]
    meets_rate = [b for b in batch_sizes
                  if request_rate_capacity_per_s(profile, b, output_tokens) >= rate_s]
    return _point(demand, num_replicas, meets_rate[0] if meets_rate else batch_sizes[-1])


def size_model(demand: ModelDemand, max_replicas: int) -> OperatingPoint:
    """The paper's operating point (batch size, DP degree) whose F_M the placer charges;
    `PlacementInfeasible` when no DP degree up to `max_replicas` meets rate and SLO."""
    _check_slo_feasible(demand)
    for num_replicas in range(1, max(1, max_replicas) + 1):
        point = point_for(demand, num_replicas)
        if point.meets_slo:
            return point
    raise PlacementInfeasible(
        f"rate {demand.request_rate_per_s}/s within TTFT SLO {demand.ttft_slo_s} s needs more "
        f"than {max_replicas} replicas (the number of candidate GPU groups)")


def operating_ladder(demand: ModelDemand, max_replicas: int) -> tuple[OperatingPoint, ...]:
    """The points a placer may use for `demand`, best first (see the module docstring)."""
    _check_slo_feasible(demand)
    max_replicas = max(1, max_replicas)
    try:
        top = size_model(demand, max_replicas)
    except PlacementInfeasible:
        top = point_for(demand, max_replicas)
    ladder = [top] + [point_for(demand, n) for n in range(top.num_replicas - 1, 0, -1)]
    smallest_batch = int(demand.profile.throughput_tokens_per_s.xs[0])
    if ladder[-1].batch_size > smallest_batch:
        ladder.append(_point(demand, 1, smallest_batch))
    return tuple(ladder)

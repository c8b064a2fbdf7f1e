"""The placers' working state: what each GPU holds while a plan is being built.

    remaining_bytes[g] = memory_bytes[g] - sum(fixed_bytes of residents on g) >= 0

The state is private to one `place()` call; the frozen `PlacementPlan` is built from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fineslab.scheduler.placement.base import (
    GpuSpec,
    ModelDemand,
    OperatingPoint,
    PlacementPlan,
    ReducedModel,
    ReplicaPlacement,
    UnplacedModel,
)
from fineslab.scheduler.placement.scoring import Resident, water_fill
from fineslab.scheduler.placement.sizing import candidate_groups


@dataclass(frozen=True)
class Replica:
    """One DP replica to place, sized."""

    demand: ModelDemand
    index: int
    point: OperatingPoint
    resident: Resident

    @property
    def total_fixed_bytes(self) -> int:
        """F_M of the replica over all its ranks (the sort key of Algorithm 1)."""
        return self.point.fixed_bytes * self.demand.tp


def make_replicas(demand: ModelDemand, point: OperatingPoint) -> list[Replica]:
    """The `point.num_replicas` DP replicas of `demand` at `point`."""
    kv_base_total = float(point.kv_base_bytes * demand.tp)
    weight = point.rate_per_replica_s * (demand.profile.workload.prompt_tokens
                                         + demand.profile.workload.output_tokens)
    replicas = []
    for index in range(point.num_replicas):
        resident = Resident(f"{demand.name}#{index}", demand.name, demand.tp,
                            point.fixed_bytes, kv_base_total, demand.profile.mme,
                            rate_weight=weight / demand.ttft_slo_s)
        replicas.append(Replica(demand, index, point, resident))
    return replicas


class ClusterState:
    def __init__(self, gpus: Sequence[GpuSpec]) -> None:
        self.gpus = {g.gpu_id: g for g in gpus}
        self.remaining_bytes = {g.gpu_id: g.memory_bytes for g in gpus}
        self.residents: dict[int, list[Resident]] = {g.gpu_id: [] for g in gpus}
        self.placed: list[tuple[Replica, tuple[int, ...], float]] = []
        self._by_key: dict[str, tuple[Replica, tuple[int, ...]]] = {}

    def replica_of(self, key: str) -> Replica:
        return self._by_key[key][0]

    def gpus_of(self, key: str) -> tuple[int, ...]:
        """The GPUs the placed replica `key` runs on."""
        return self._by_key[key][1]

    def group_residents(self, group: tuple[int, ...]) -> list[Resident]:
        seen: dict[str, Resident] = {}
        for gpu_id in group:
            for r in self.residents[gpu_id]:
                seen[r.key] = r
        return list(seen.values())

    def fits(self, replica: Replica, group: tuple[int, ...]) -> bool:
        """Memory fits on every GPU and no other replica of the model is there (DP replicas
        on one GPU would add no compute)."""
        return all(self.remaining_bytes[g] >= replica.point.fixed_bytes
                   and all(r.model != replica.demand.name for r in self.residents[g])
                   for g in group)

    def feasible_groups(self, replica: Replica) -> list[tuple[int, ...]]:
        groups = candidate_groups(list(self.gpus.values()), replica.demand.tp,
                                  replica.demand.profile.device)
        return [grp for grp in groups if self.fits(replica, grp)]

    def k_rem_after(self, replica: Replica, group: tuple[int, ...]) -> float:
        """K_rem(G'): contested bytes left on the group after charging F_M."""
        return float(sum(self.remaining_bytes[g] for g in group)
                     - replica.point.fixed_bytes * len(group))

    def add(self, replica: Replica, group: tuple[int, ...], score: float) -> None:
        for g in group:
            self.remaining_bytes[g] -= replica.point.fixed_bytes
            self.residents[g].append(replica.resident)
        self.placed.append((replica, group, score))
        self._by_key[replica.resident.key] = (replica, group)

    def no_fit_reason(self, replica: Replica) -> str:
        largest = max(self.remaining_bytes.values(), default=0)
        return (f"no room left: replica {replica.index} needs "
                f"{replica.point.fixed_bytes / 2**30:.2f} GiB per GPU (batch "
                f"{replica.point.batch_size}) on {replica.demand.tp} "
                f"{replica.demand.profile.device} GPU(s) without another replica of it; the "
                f"largest free space left is {largest / 2**30:.2f} GiB")

    def placed_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for replica, _, _ in self.placed:
            counts[replica.demand.name] = counts.get(replica.demand.name, 0) + 1
        return counts


ShareSplitter = Callable[[ClusterState, int], dict[str, float]]


def mme_shares(state: ClusterState, gpu_id: int) -> dict[str, float]:
    """Expected contested bytes per resident of a GPU: water-filling over their MME curves."""
    return water_fill(state.residents[gpu_id], state.remaining_bytes[gpu_id],
                      rank_scale=True)[1]


def to_plan(policy: str, state: ClusterState, unplaced: Sequence[UnplacedModel],
            shares: ShareSplitter = mme_shares,
            partitions: dict[str, int] | None = None,
            reduced: Sequence[ReducedModel] = ()) -> PlacementPlan:
    split = {g: shares(state, g) for g in state.gpus}
    replicas = []
    for replica, group, score in state.placed:
        key = replica.resident.key
        share = min(split[g].get(key, 0.0) for g in group)
        replicas.append(ReplicaPlacement(
            model=replica.demand.name, replica=replica.index, gpu_ids=group,
            operating_point=replica.point, contested_share_bytes=int(share),
            partition_bytes=None if partitions is None else partitions[key], score=score))
    return PlacementPlan(policy, tuple(state.gpus.values()), tuple(replicas), tuple(unplaced),
                         tuple(reduced))

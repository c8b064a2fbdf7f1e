"""Baseline placers behind the same protocol as Algorithm 1.

KVPR (Prism, paper 002 section 6.1, as FineServe's Prism* runs it): replicas sorted by their
SLO-weighted token rate w_m = rate * (prompt + output tokens) / TTFT SLO, descending; each goes
to the candidate with the lowest KV pressure ratio after adding it,

    KVPR(G') = sum_{m in G'} w_m / (sum_{g in G} T_g - sum_{m in G'} (weights_m + act_m))

It counts tokens, not bytes, so it is blind to KV precision. Its contested memory is split in
proportion to w_m ("splits remaining KV by an SLO-to-request-rate ratio").

Static (the paper's Static*): Algorithm 1's placement, then each GPU's memory is cut into fixed
partitions proportional to the footprints F_m of its residents; a replica's partition is
F_m * T_g / sum F, its share of contested memory partition - F_m, and it can never use more.
"""

from __future__ import annotations

from collections.abc import Sequence

from fineslab.scheduler.placement.base import (
    GpuSpec,
    ModelDemand,
    PlacementConfig,
    PlacementPlan,
)
from fineslab.scheduler.placement.degrade import place_degrading
from fineslab.scheduler.placement.mme import MmePlacer
from fineslab.scheduler.placement.state import ClusterState, Replica, to_plan


def kvpr_shares(state: ClusterState, gpu_id: int) -> dict[str, float]:
    residents = state.residents[gpu_id]
    total_weight = sum(r.rate_weight for r in residents) or 1.0
    return {r.key: state.remaining_bytes[gpu_id] * r.rate_weight / total_weight
            for r in residents}


class KvprPlacer:
    name = "kvpr"

    def place(self, models: Sequence[ModelDemand], gpus: Sequence[GpuSpec], *,
              allow_unplaced: bool = False) -> PlacementPlan:
        state, unplaced, reduced = place_degrading(
            models, gpus, lambda replicas: self._place_pass(replicas, gpus), allow_unplaced)
        return to_plan(self.name, state, unplaced, shares=kvpr_shares, reduced=reduced)

    def _place_pass(self, replicas: list[Replica], gpus: Sequence[GpuSpec]) -> ClusterState:
        state = ClusterState(gpus)
        order = sorted(replicas, key=lambda r: (-r.resident.rate_weight, r.demand.name, r.index))
        for replica in order:
            best = self._lowest_pressure(state, replica)
            if best is not None:
                state.add(replica, best[0], best[1])
        return state

    @staticmethod
    def _lowest_pressure(state: ClusterState, replica: Replica,
                         ) -> tuple[tuple[int, ...], float] | None:
        best: tuple[tuple[int, ...], float] | None = None
        for group in state.feasible_groups(replica):
            members = [*state.group_residents(group), replica.resident]
            weights_bytes = sum(_non_kv_bytes(m.fixed_bytes, m.kv_base_bytes, m.tp) * m.tp
                                for m in members)
            kv_avail = sum(state.gpus[g].memory_bytes for g in group) - weights_bytes
            if kv_avail <= 0:
                continue
            pressure = sum(m.rate_weight for m in members) / kv_avail
            if best is None or pressure < best[1]:
                best = (group, pressure)
        return best


def _non_kv_bytes(fixed_bytes: int, kv_base_total_bytes: float, tp: int) -> float:
    """Weights plus activations per rank: F minus the base KV."""
    return fixed_bytes - kv_base_total_bytes / tp


class StaticPlacer:
    """Algorithm 1's placement ("placement follows the same policy as FineServe"), told the
    same `config`, then F_M-proportional partitions."""

    name = "static"

    def __init__(self, config: PlacementConfig | None = None) -> None:
        self.config = config or PlacementConfig()

    def place(self, models: Sequence[ModelDemand], gpus: Sequence[GpuSpec], *,
              allow_unplaced: bool = False) -> PlacementPlan:
        state, unplaced, reduced = MmePlacer("proxy", self.config).place_into_state(
            models, gpus, allow_unplaced)
        partitions = self._partitions(state)
        shares = {g: {key: float(part - _fixed_of(state, g, key))
                      for key, part in partitions[g].items()} for g in state.gpus}
        per_replica = {key: min(partitions[g][key] for g in group)
                       for replica, group, _ in state.placed
                       for key in [replica.resident.key]}
        return to_plan(self.name, state, unplaced, shares=lambda _state, g: shares[g],
                       partitions=per_replica, reduced=reduced)

    @staticmethod
    def _partitions(state: ClusterState) -> dict[int, dict[str, int]]:
        partitions: dict[int, dict[str, int]] = {}
        for gpu_id, residents in state.residents.items():
            total_fixed = sum(r.fixed_bytes for r in residents) or 1
            memory = state.gpus[gpu_id].memory_bytes
            partitions[gpu_id] = {r.key: memory * r.fixed_bytes // total_fixed
                                  for r in residents}
        return partitions


def _fixed_of(state: ClusterState, gpu_id: int, key: str) -> int:
    return next(r.fixed_bytes for r in state.residents[gpu_id] if r.key == key)

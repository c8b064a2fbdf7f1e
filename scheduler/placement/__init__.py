"""Global placer: model replicas onto GPUs, policies chosen by name.

    plan = get_placement_policy("mme").place(demands, gpus)   # "mme-exact", "kvpr", "static"
    print(plan.table())
"""

from __future__ import annotations

from collections.abc import Callable

from fineslab.scheduler.placement.base import (
    GpuSpec,
    ModelDemand,
    OperatingPoint,
    PlacementPlan,
    PlacementPolicy,
    ReducedModel,
    ReplicaPlacement,
    UnplacedModel,
)
from fineslab.scheduler.placement.baselines import KvprPlacer, StaticPlacer
from fineslab.scheduler.placement.mme import MmePlacer
from fineslab.scheduler.placement.sizing import candidate_groups, operating_ladder, size_model

from fineslab.errors import ConfigError

PLACEMENT_POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "mme": lambda: MmePlacer("proxy"),
    "mme-exact": lambda: MmePlacer("exact"),
    "kvpr": KvprPlacer,
    "static": StaticPlacer,
}


def get_placement_policy(name: str) -> PlacementPolicy:
    try:
        return PLACEMENT_POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown placement policy {name!r}; known: "
                          f"{sorted(PLACEMENT_POLICIES)}") from None


__all__ = [
    "PLACEMENT_POLICIES", "GpuSpec", "KvprPlacer", "MmePlacer", "ModelDemand", "OperatingPoint",
    "PlacementPlan", "PlacementPolicy", "ReducedModel", "ReplicaPlacement", "StaticPlacer",
    "UnplacedModel", "candidate_groups", "get_placement_policy", "operating_ladder", "size_model",
]

"""Global placer: model replicas onto GPUs, policies chosen by name.

    plan = get_placement_policy("mme").place(demands, gpus)   # "mme-exact", "kvpr", "static"
    print(plan.table())

    # told what co-location costs (the MME placers and Static use it, KVPR does not)
    get_placement_policy("mme", PlacementConfig(interference_per_neighbor=0.2))
"""

from __future__ import annotations

from typing import Protocol

from fineslab.scheduler.placement.base import (
    GpuSpec,
    ModelDemand,
    OperatingPoint,
    PlacementConfig,
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


class PlacerFactory(Protocol):
    def __call__(self, config: PlacementConfig | None = None) -> PlacementPolicy: ...


PLACEMENT_POLICIES: dict[str, PlacerFactory] = {
    "mme": lambda config=None: MmePlacer("proxy", config),
    "mme-exact": lambda config=None: MmePlacer("exact", config),
    "kvpr": lambda config=None: KvprPlacer(),  # Prism's KVPR has no compute term
    "static": lambda config=None: StaticPlacer(config),
}


def get_placement_policy(name: str, config: PlacementConfig | None = None) -> PlacementPolicy:
    try:
        factory = PLACEMENT_POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown placement policy {name!r}; known: "
                          f"{sorted(PLACEMENT_POLICIES)}") from None
    return factory(config)


__all__ = [
    "PLACEMENT_POLICIES", "GpuSpec", "KvprPlacer", "MmePlacer", "ModelDemand", "OperatingPoint",
    "PlacementConfig", "PlacementPlan", "PlacementPolicy", "PlacerFactory", "ReducedModel",
    "ReplicaPlacement", "StaticPlacer", "UnplacedModel", "candidate_groups",
    "get_placement_policy", "operating_ladder", "size_model",
]

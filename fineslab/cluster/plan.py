"""The global placement of a fleet over the nodes of a cluster, and each node's share of it.

    nodes' devices (each agent resolves `devices:` on its node)
        --> one GPU list, ids 0..N-1 in node order (`slots`: id -> node, local device index)
        --> the fleet's placer over all of them (a replica never spans nodes)
        --> per node: the placement restricted to its devices, ids renumbered 0..n-1,
            which that node's launcher plans arenas and runtimes from (`make_plan(...,
            placement=)`)

After a node is lost, `place_on_residual` places the lost node's models onto what the
surviving devices have left (their memory less the footprints and arenas already there), so
that nothing already serving is restarted; the models that do not fit are named.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fineslab.errors import ConfigError, PlacementInfeasible
from fineslab.fleet.config import GIB, DeviceConfig, FleetConfig
from fineslab.fleet.plan import _demands, model_dir_of
from fineslab.fleet.profiles import find_profile, profile_dirs
from fineslab.scheduler.placement import GpuSpec, PlacementPlan, get_placement_policy
from fineslab.scheduler.profile_schema import ModelProfile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeDevices:
    """A node of the cluster as its agent found it."""

    node: str
    devices: tuple[DeviceConfig, ...]


@dataclass(frozen=True)
class ClusterPlan:
    config: FleetConfig
    nodes: tuple[NodeDevices, ...]
    placement: PlacementPlan
    #: global GPU id -> (node, index of the device on that node)
    slots: tuple[tuple[str, int], ...]

    def node_of(self, gpu_ids: Sequence[int]) -> str:
        nodes = {self.slots[g][0] for g in gpu_ids}
        if len(nodes) != 1:
            raise ConfigError(f"a replica over GPUs {list(gpu_ids)} spans nodes {sorted(nodes)}; "
                              "a TP group never spans nodes")
        return nodes.pop()

    def models_on(self, node: str) -> list[str]:
        """The models (config names) with a replica on `node`, in config order."""
        names = {r.model.split("#")[0] for r in self.placement.replicas
                 if self.node_of(r.gpu_ids) == node}
        return [m.name for m in self.config.models if m.name in names]

    def node_placement(self, node: str) -> PlacementPlan:
        """The placement of `node`'s replicas, GPU ids renumbered to its device indices."""
        local = {g: index for g, (name, index) in enumerate(self.slots) if name == node}
        gpus = tuple(dataclasses.replace(self.placement.gpus[g], gpu_id=index)
                     for g, index in sorted(local.items(), key=lambda item: item[1]))
        replicas = tuple(dataclasses.replace(r, gpu_ids=tuple(local[g] for g in r.gpu_ids))
                         for r in self.placement.replicas if self.node_of(r.gpu_ids) == node)
        return dataclasses.replace(self.placement, gpus=gpus, replicas=replicas, unplaced=(),
                                   reduced=())

    def node_config(self, node: str, generation: int = 0) -> FleetConfig:
        """The fleet config `node`'s launcher runs: its devices, the models placed there, a
        fleet id of its own (arenas of two nodes on one machine never share a name)."""
        devices = next(n.devices for n in self.nodes if n.node == node)
        names = set(self.models_on(node))
        suffix = f"-{node}" + (f"-g{generation}" if generation else "")
        return self.config.model_copy(update={
            "fleet_id": f"{self.config.fleet_id}{suffix}"[:64], "devices": devices,
            "models": tuple(m for m in self.config.models if m.name in names), "cluster": None})

    def describe(self) -> str:
        lines = [self.placement.table(), "", "nodes"]
        for n in self.nodes:
            models = self.models_on(n.node)
            lines.append(f"  {n.node}: {[d.name for d in n.devices]} -> "
                         f"{models or 'nothing placed'}")
        return "\n".join(lines)


def cluster_profiles(config: FleetConfig, kind: str, cache_dir: str | None = None
                     ) -> dict[str, ModelProfile]:
    """Each model's profile for device `kind` (the same lookup as one machine's launcher)."""
    dirs = profile_dirs(config.profile_dirs)
    return {m.name: find_profile(m, kind, dirs, model_dir_of(m, cache_dir))
            for m in config.models}


def _slots(nodes: Sequence[NodeDevices]) -> tuple[tuple[str, int], ...]:
    return tuple((n.node, i) for n in nodes for i in range(len(n.devices)))


def device_kind(nodes: Sequence[NodeDevices]) -> str:
    """The one device kind of the cluster; ConfigError for none or several."""
    kinds = sorted({d.kind for n in nodes for d in n.devices})
    if not kinds:
        raise ConfigError("no node of the cluster has a device")
    if len(kinds) > 1:
        raise ConfigError(f"devices of several kinds {kinds} in one fleet are not supported")
    return kinds[0]


def make_cluster_plan(config: FleetConfig, nodes: Sequence[NodeDevices],
                      cache_dir: str | None = None,
                      profiles: Mapping[str, ModelProfile] | None = None) -> ClusterPlan:
    """The fleet's placer over every node's devices; raises PlacementInfeasible like one
    machine's launcher when a model cannot be placed."""
    profiles = dict(profiles or cluster_profiles(config, device_kind(nodes), cache_dir))
    slots = _slots(nodes)
    gpus = [GpuSpec(g, d.memory_bytes, d.kind) for g, d in
            enumerate(d for n in nodes for d in n.devices)]
    placement = get_placement_policy(config.placement).place(_demands(config, profiles), gpus)
    plan = ClusterPlan(config, tuple(nodes), placement, slots)
    for replica in placement.replicas:
        plan.node_of(replica.gpu_ids)  # raises for a replica across nodes
    return plan


def place_on_residual(config: FleetConfig, survivors: Sequence[NodeDevices],
                      used_bytes: Mapping[tuple[str, str], int], models: Sequence[str],
                      profiles: Mapping[str, ModelProfile]
                      ) -> tuple[ClusterPlan | None, list[str]]:
    """Place `models` on what the `survivors`' devices have left: each device's memory less
    `used_bytes[(node, device)]` (footprints and arenas of what already runs there).

    All of them at once if they fit, else one by one in config order, skipping those that do
    not. Returns the plan (None when nothing fits) and the models left unplaced."""
    residual = tuple(
        NodeDevices(n.node, tuple(d.model_copy(update={"memory_gib": max(
            1, d.memory_bytes - used_bytes.get((n.node, d.name), 0)) / GIB})
            for d in n.devices))
        for n in survivors if n.devices)
    if not residual:
        return None, list(models)
    wanted = [m.name for m in config.models if m.name in set(models)]

    def place(names: list[str]) -> ClusterPlan:
        only = config.with_models([m for m in config.models if m.name in set(names)])
        return make_cluster_plan(only, residual, profiles=profiles)

    try:
        return place(wanted), []
    except PlacementInfeasible as exc:
        logger.warning("the lost models do not fit the survivors together (%s); placing them "
                       "one by one", exc)
    plan: ClusterPlan | None = None
    placed: list[str] = []
    for name in wanted:
        try:
            plan, placed = place([*placed, name]), [*placed, name]
        except PlacementInfeasible as exc:
            logger.warning("model %s does not fit what the surviving nodes have left: %s",
                           name, exc)
    return plan, [m for m in models if m not in placed]

"""The node agent: one Ray actor per node that owns the node's arenas (issue #21).

    launcher (driver)                      node "a"                     node "b"
      spawn_agent("a") ------------------> NodeAgent("a")               NodeAgent("b")
      agent.create_arena(spec) ----------> SlabArena.create (its shm)   ...
      agent.snapshot(device) <------------ table snapshot (as_dict)

An agent is pinned to its node by the node's naming resource (`local.node_resource`) and takes
no CPU slot (num_cpus=0), so it never waits behind other work. It creates each arena of its
node and unlinks it on `close()`. When its node dies, calls to it raise `ray.exceptions.
RayActorError` (`ActorUnavailableError`, a subclass, may come first and is transient:
`is_lost` tells the two apart); the arena files of a lost node are that node's to reclaim
(`SlabArena.create` reclaims a file whose creator is dead).

Built so far: the arenas. Still to come (issue #21): the node's SGLang runtimes and their
supervision, its router, the front router and re-placement after a node loss.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fineslab.errors import ConfigError
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.inspector import as_dict
from fineslab.slabs.integrity import snapshot

logger = logging.getLogger(__name__)


class NodeAgent:
    """What runs inside the actor (plain Python: the tests also call it in process)."""

    def __init__(self, node_name: str, shm_dir: str | None = None) -> None:
        self.node_name = node_name
        self.shm_dir = shm_dir
        self.arenas: dict[str, SlabArena] = {}

    def describe(self) -> dict[str, Any]:
        """Node name, Ray node id (None outside Ray), pid, and its arenas' devices."""
        node_id = None
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"node": self.node_name, "node_id": node_id, "pid": os.getpid(),
                "devices": sorted(self.arenas)}

    def create_arena(self, spec: ArenaSpec) -> dict[str, Any]:
        """Create the arena of `spec.device` on this node; returns its snapshot."""
        if spec.device in self.arenas:
            raise ConfigError(f"node {self.node_name}: an arena for {spec.device} exists")
        from pathlib import Path

        arena = SlabArena.create(spec, shm_dir=Path(self.shm_dir) if self.shm_dir else None)
        self.arenas[spec.device] = arena
        logger.info("node %s: arena %s/%s, %d slabs of %d B", self.node_name, spec.fleet_id,
                    spec.device, spec.arena_bytes // spec.slab_bytes, spec.slab_bytes)
        return self.snapshot(spec.device)

    def snapshot(self, device: str) -> dict[str, Any]:
        """The slab table of `device` (fineslab.slabs.integrity.as_dict), lock-free."""
        arena = self.arenas.get(device)
        if arena is None:
            raise ConfigError(f"node {self.node_name} has no arena for {device}; it has "
                              f"{sorted(self.arenas) or 'none'}")
        return dict(as_dict(snapshot(arena.table)))

    def close(self) -> None:
        """Unmap and unlink every arena of this node."""
        for device in list(self.arenas):
            self.arenas.pop(device).close()


def spawn_agent(node_name: str, shm_dir: str | None = None) -> Any:
    """A `NodeAgent` actor on node `node_name` (Ray must be initialized)."""
    import ray

    from fineslab.cluster.local import node_resource

    actor = ray.remote(NodeAgent).options(
        name=f"fineslab-agent-{node_name}", resources={node_resource(node_name): 1},
        num_cpus=0, max_restarts=0)
    return actor.remote(node_name, shm_dir)


def is_lost(error: BaseException) -> bool:
    """Whether `error` from a call to an agent says its actor is gone for good (its node or
    process died), not unavailable for a moment."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(error, RayActorError) and not isinstance(error, ActorUnavailableError)

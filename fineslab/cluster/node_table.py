"""The driver's view of the cluster's nodes: each node's agent and its node fleets.

    NodeTable
      Node "a"  agent, address, devices, lost?
        NodeFleet "g0"  models, state (starting | serving | exited), router URL, used bytes
        NodeFleet "g1"  ... (models placed there after a loss, beside g0)
      Node "b"  ...

Everything the front router's routes, the next placement's room and the re-placement's
progress are computed from. All of it under one lock: the watch thread and `stop` share it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fineslab.errors import EnvironmentSetupError
from fineslab.fleet.config import DeviceConfig

NODE_RESOURCE_PREFIX = "fineslab_node_"


@dataclass
class NodeFleet:
    name: str
    models: list[str]
    used_bytes: dict[str, int] = field(default_factory=dict)
    url: str | None = None
    state: str = "starting"

    @property
    def active(self) -> bool:
        return self.state != "exited"


@dataclass
class Node:
    name: str
    node_id: str
    agent: Any
    address: str
    devices: tuple[DeviceConfig, ...] = ()
    fleets: dict[str, NodeFleet] = field(default_factory=dict)
    lost: bool = False

    def route_label(self, fleet: str) -> str:
        """The front router's name for one node fleet: the node's, `node/gN` for later ones."""
        return self.name if fleet == "g0" else f"{self.name}/{fleet}"


def node_name(info: dict[str, Any]) -> str:
    """A Ray node's name: its fineslab naming resource (`LocalCluster`), else the first 8
    hex digits of its node id."""
    for key in info.get("Resources", {}):
        if key.startswith(NODE_RESOURCE_PREFIX):
            return str(key[len(NODE_RESOURCE_PREFIX):])
    return str(info["NodeID"])[:8]


def alive_nodes() -> list[dict[str, Any]]:
    """The live nodes of the connected Ray cluster (`ray.nodes()` entries)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def wait_for_nodes(address: str, want: int, wait_s: float) -> list[dict[str, Any]]:
    """The live nodes once there are `want` of them; EnvironmentSetupError after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = alive_nodes()
        if len(alive) >= want:
            return alive
        if time.monotonic() >= deadline:
            raise EnvironmentSetupError(
                f"the Ray cluster at {address} has {len(alive)} node(s), the fleet wants at "
                f"least {want} (cluster.min_nodes); waited {wait_s:g} s (cluster.wait_nodes_s)")
        time.sleep(0.5)


class NodeTable:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.lock = threading.RLock()

    def add(self, node: Node) -> None:
        with self.lock:
            self.nodes[node.name] = node

    def live(self) -> list[Node]:
        with self.lock:
            return [n for n in self.nodes.values() if not n.lost]

    def known_ids(self) -> set[str]:
        with self.lock:
            return {n.node_id for n in self.nodes.values()}

    def note(self, fleet: NodeFleet, status: dict[str, Any]) -> bool:
        """Record a node fleet's status from its agent; whether it started serving now."""
        with self.lock:
            if status["state"] == "serving" and fleet.state != "serving":
                fleet.state, fleet.url = "serving", str(status["url"])
                fleet.used_bytes = {str(k): int(v) for k, v in status["used_bytes"].items()}
                return True
            if status["state"] == "exited":
                fleet.state = "exited"
            return False

    def routes(self, models: list[str]) -> dict[str, list[tuple[str, str]]]:
        """Each model's serving node fleets: (route label, router URL)."""
        routes: dict[str, list[tuple[str, str]]] = {m: [] for m in models}
        with self.lock:
            for node in self.live():
                for fleet in node.fleets.values():
                    if fleet.state == "serving" and fleet.url:
                        for model in fleet.models:
                            routes.setdefault(model, []).append(
                                (node.route_label(fleet.name), fleet.url))
        return routes

    def used_bytes(self) -> dict[tuple[str, str], int]:
        """Per (node, device): footprints and arenas of the live node fleets there."""
        used: dict[tuple[str, str], int] = {}
        with self.lock:
            for node in self.live():
                for fleet in node.fleets.values():
                    if fleet.active:
                        for device, num_bytes in fleet.used_bytes.items():
                            used[(node.name, device)] = used.get((node.name, device), 0) \
                                + num_bytes
        return used

    def placed(self, model: str) -> bool:
        """Whether a live node fleet serves `model` or is starting it."""
        with self.lock:
            return any(model in f.models and f.active for n in self.live()
                       for f in n.fleets.values())

    def serving(self, model: str) -> bool:
        with self.lock:
            return any(model in f.models and f.state == "serving" for n in self.live()
                       for f in n.fleets.values())


class RouterProbes:
    """Probes each serving node router's `/health` every `interval_s`: one that does not
    answer within `timeout_s` (any HTTP status is an answer; a 503 while a runtime restarts is
    its router working) `failures` times in a row is hung, e.g. its node fleet SIGSTOPped:
    the agent's view (the process is alive) cannot tell."""

    def __init__(self, interval_s: float, timeout_s: float, failures: int) -> None:
        self.interval_s, self.timeout_s, self.failures = interval_s, timeout_s, failures
        self._misses: dict[str, int] = {}
        self._next_s = time.monotonic() + interval_s

    def due(self) -> bool:
        return time.monotonic() >= self._next_s

    def hung(self, urls: list[str]) -> list[str]:
        """Probe `urls` at once; those that have now missed `failures` probes in a row."""
        import concurrent.futures

        self._next_s = time.monotonic() + self.interval_s
        if not urls:
            return []
        with concurrent.futures.ThreadPoolExecutor(min(8, len(urls))) as pool:
            answered = dict(zip(urls, pool.map(self._answers, urls), strict=True))
        self._misses = {u: 0 if answered[u] else self._misses.get(u, 0) + 1 for u in urls}
        return [u for u in urls if self._misses[u] >= self.failures]

    def _answers(self, url: str) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(url + "/health", timeout=self.timeout_s):
                return True
        except urllib.error.HTTPError:
            return True  # it answered
        except (OSError, ValueError):
            return False

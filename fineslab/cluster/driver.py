"""The fleet over a Ray cluster: agents, the global placement, node fleets, the front router.

    start: front port bound (a taken port fails at once) -> Ray connected -> wait for
           `min_nodes` -> one NodeAgent per node -> each node's devices -> the global placement
           (fineslab.cluster.plan) -> each node's share started by its agent (arenas, runtimes,
           node router) -> all serving -> front router routes by model to the node routers
    watch: fineslab.cluster.watch: node loss, exited or hung node fleets, re-placement on
           what the survivors have left (nothing serving is restarted), nodes that join
    stop:  watch -> front router -> every node fleet (runtimes, node routers, arenas) -> the
           agents -> Ray disconnected (when this driver connected it)

Each node runs the one-machine launcher (fineslab.cluster.node_fleet); nothing here imports SGLang.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fineslab.cluster.front import FrontRouter, FrontSettings
from fineslab.cluster.front_app import FrontServer
from fineslab.cluster.node_fleet import NodeSpec
from fineslab.cluster.node_table import (
    Node,
    NodeFleet,
    NodeTable,
    RouterProbes,
    node_name,
    wait_for_nodes,
)
from fineslab.cluster.plan import (
    ClusterPlan,
    NodeDevices,
    cluster_profiles,
    device_kind,
    make_cluster_plan,
)
from fineslab.cluster.watch import CALL_TIMEOUT_S, HUNG_PROBE_TIMEOUT_S, WATCH_S, Watch
from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.fleet.config import FleetConfig
from fineslab.router.server import bind_router_socket
from fineslab.scheduler.profile_schema import ModelProfile

logger = logging.getLogger(__name__)

#: How long a new agent may take to start and report its node's devices.
AGENT_START_S = 120.0


class ClusterFleet(Watch):
    """A fleet over every node of the Ray cluster at `address` (None: the config's)."""

    def __init__(self, config: FleetConfig, port: int | None = None,
                 log_dir: str | None = None, progress: Callable[[str], None] = logger.info,
                 address: str | None = None) -> None:
        if config.cluster is None and address is None:
            raise ConfigError("a cluster fleet needs `cluster:` in the config or an address")
        self.config, self.progress = config, progress
        self.address = address or (config.cluster.address if config.cluster else "auto")
        self.port = config.router.port if port is None else port
        #: a temporary log folder is removed at a clean stop unless a node or node fleet was lost
        self._temp_logs = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"fineslab-{config.fleet_id}-"))
        self.table = NodeTable()
        self.plan: ClusterPlan | None = None
        self.profiles: dict[str, ModelProfile] = {}
        self.unplaced: list[str] = []
        self.front: FrontRouter | None = None
        self.server: FrontServer | None = None
        self._socket: socket.socket | None = None
        self._connected = False
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None
        policy = config.supervision
        self.probes = RouterProbes(policy.probe_interval_s, min(policy.probe_timeout_s,
                                                                HUNG_PROBE_TIMEOUT_S),
                                   policy.probe_failures)
        self._generation = 0
        self._run = uuid.uuid4().hex[:6]
        #: node loss -> its models serving again, for the last re-placement (bench.cluster)
        self.replaced_s: float | None = None
        self._replacing: tuple[float, set[str]] | None = None
        self.api_key = self._api_key()

    def _api_key(self) -> str | None:
        name = self.config.router.api_key_env
        if name is not None and not os.environ.get(name):
            raise ConfigError(f"router.api_key_env names {name}, which is not set")
        return None if name is None else os.environ[name]

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        router = self.config.router
        self._socket = bind_router_socket(router.host, self.port)
        self.port = self._socket.getsockname()[1]
        self.plan = self.make_plan()
        self._start_share(self.plan)
        self._wait_serving(self.config.supervision.health_timeout_s + 120)
        self.front = FrontRouter(FrontSettings(
            api_key=self.api_key, max_body_bytes=router.max_body_bytes,
            upstream_timeout_s=router.upstream_timeout_s,
            retry_after_s=max(1, router.retry_after_s), node_api_key=self.api_key))
        self._publish_routes()
        self.server = FrontServer(self.front, router.host, self.port, sock=self._socket)
        self._socket = None
        self.server.start()
        self._watch = threading.Thread(target=self._watch_loop, name="fineslab-cluster-watch",
                                       daemon=True)
        self._watch.start()
        self.progress(f"front router serving {[m.name for m in self.config.models]} on "
                      f"{self.server.base_url}/v1 over {len(self.table.nodes)} node(s)")

    def make_plan(self) -> ClusterPlan:
        """Connect, give every node an agent, place the fleet over their devices (what
        `--dry-run` prints; `stop()` undoes it)."""
        self._connect()
        cluster = self.config.cluster
        for info in wait_for_nodes(self.address, cluster.min_nodes if cluster else 1,
                                   cluster.wait_nodes_s if cluster else 0):
            self._add_node(info)
        nodes = [NodeDevices(n.name, n.devices) for n in self.table.live()]
        self.profiles = cluster_profiles(self.config, device_kind(nodes))
        plan = make_cluster_plan(self.config, nodes, profiles=self.profiles)
        self.progress(plan.describe())
        return plan

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            try:
                ray.init(address=self.address, logging_level=logging.WARNING,
                         log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise EnvironmentSetupError(
                    f"cannot connect to the Ray cluster at {self.address} ({exc}); start it "
                    "with `ray start --head` or give its address (--ray, cluster.address)"
                    ) from None
            self._connected = True
        self.progress(f"connected to the Ray cluster at {self.address}")

    def _add_node(self, info: dict[str, Any]) -> Node:
        import ray

        from fineslab.cluster.agent import spawn_agent

        name = node_name(info)
        agent = spawn_agent(name, node_id=info["NodeID"],
                            num_gpus=float(info.get("Resources", {}).get("GPU", 0)),
                            actor_name=f"fineslab-{self.config.fleet_id}-{self._run}-{name}")
        try:
            described = ray.get(agent.describe.remote(), timeout=AGENT_START_S)
            devices = tuple(ray.get(agent.devices.remote(self.config), timeout=AGENT_START_S))
        except ray.exceptions.GetTimeoutError:
            raise EnvironmentSetupError(
                f"node {name}: its agent did not start within {AGENT_START_S:.0f} s (it needs "
                "all of the node's GPUs: does other Ray work hold some?)") from None
        node = Node(name, info["NodeID"], agent, described["address"] or "127.0.0.1", devices)
        self.table.add(node)
        self.progress(f"node {name} ({node.address}): agent pid {described['pid']}, devices "
                      f"{[d.name for d in node.devices]}")
        return node

    def _start_share(self, plan: ClusterPlan) -> None:
        """Start each node's share of `plan` as a new node fleet of that node."""
        import ray

        generation, self._generation = self._generation, self._generation + 1
        fleet = f"g{generation}"
        key_env = self.config.router.api_key_env
        env = {key_env: self.api_key} if key_env and self.api_key else {}
        for share in plan.nodes:
            models = plan.models_on(share.node)
            if not models:
                continue
            node = self.table.nodes[share.node]
            spec = NodeSpec(plan.node_config(share.node, generation),
                            plan.node_placement(share.node), node.address,
                            str(self.log_dir / f"{share.node}-{fleet}"))
            with self.table.lock:
                node.fleets[fleet] = NodeFleet(fleet, models)
            ray.get(node.agent.start_fleet.remote(fleet, spec, env), timeout=CALL_TIMEOUT_S * 6)
            self.progress(f"node {share.node}: starting {models} (fleet {fleet}, logs in "
                          f"{spec.log_dir})")

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        said: dict[str, str] = {}
        while True:
            pending = []
            for node in self.table.live():
                for name, status in self._statuses(node).items():
                    fleet = node.fleets.get(name)
                    if fleet is None:
                        continue
                    if self.table.note(fleet, status):
                        self._say_serving(node, fleet, status)
                    if status["state"] == "exited":
                        raise EnvironmentSetupError(
                            f"node {node.name}: fleet {name} exited with {status.get('rc')} "
                            f"while starting; its log ({status.get('log')}) ends:\n"
                            f"{status.get('log_tail', '')}")
                    if status["state"] == "starting":
                        pending.append(node.name)
                        line = str(status.get("progress", "")).strip()
                        if line and said.get(node.name) != line:
                            said[node.name] = line
                            self.progress(f"node {node.name}: {line[-200:]}")
            if not pending:
                return
            if time.monotonic() > deadline:
                raise EnvironmentSetupError(f"nodes {sorted(set(pending))} not serving after "
                                            f"{timeout_s:.0f} s")
            time.sleep(WATCH_S)

    def _statuses(self, node: Node) -> dict[str, dict[str, Any]]:
        import ray

        return dict(ray.get(node.agent.fleet_status.remote(), timeout=CALL_TIMEOUT_S))

    def _say_serving(self, node: Node, fleet: NodeFleet, status: dict[str, Any]) -> None:
        self.progress(f"node {node.name}: fleet {fleet.name} serving {fleet.models} on "
                      f"{fleet.url} (node fleet pid {status.get('pid')})")

    def _publish_routes(self) -> None:
        assert self.front is not None
        self.front.set_routes(self.table.routes([m.name for m in self.config.models]))

    # -- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything this fleet started, whatever phase it is in."""
        import ray

        self._stop.set()
        if self._watch is not None:
            self._watch.join(CALL_TIMEOUT_S + 5)
        if self.server is not None:
            self.server.stop()
        if self._socket is not None:
            self._socket.close()
        live = self.table.live()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(live))) as pool:
            list(pool.map(self._close_node, live))
        for node in self.table.nodes.values():
            with contextlib.suppress(Exception):
                ray.kill(node.agent)
        if self._connected:
            with contextlib.suppress(Exception):
                ray.shutdown()
        lost = any(n.lost or any(not f.active for f in n.fleets.values())
                   for n in self.table.nodes.values())
        if self._temp_logs and not lost:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        elif lost:
            self.progress(f"logs kept in {self.log_dir} (a node or node fleet was lost)")
        self.progress("cluster fleet stopped")

    def _close_node(self, node: Node) -> None:
        import ray

        try:
            stopped = ray.get(node.agent.close.remote(), timeout=120)
            logger.info("node %s: fleets stopped %s", node.name, stopped)
        except Exception as exc:
            logger.warning("node %s: stopping its fleets failed (%s); its runtimes' lifelines "
                           "stop them when the agent goes", node.name, exc)

"""A Ray cluster of several nodes on one machine: for the tests and the CPU benchmark.

Each node is a real raylet started by `ray.cluster_utils.Cluster` (head first), a child of
this process, everything on loopback, and carries a custom resource naming it
(`node_resource(name)`), so a node agent can be pinned to it: both nodes of one machine have
the same IP, so Ray's own `node:<ip>` resource cannot tell them apart.

Settings, each from a pitfall measured on this project's machines (Ray 2.x, several nodes on
one host):
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   keeps `ray.init` from rewriting 127.0.0.1 to eth0's
                                          address (set before ray is imported)
    RAY_memory_monitor_refresh_ms=0       a neighbour's memory spike must not kill an agent
    RAY_AUTH_MODE=disabled                an earlier local `ray.init` leaves a token behind
    fast health checks                    a lost node is seen in about 1.5 s, not 15 s
    a short temp_dir of our own           unix socket paths are limited to 107 characters;
                                          removed at shutdown
    explicit address                      `Cluster` writes /tmp/ray/ray_current_cluster, so
                                          "auto" could attach to another test's cluster
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from fineslab import startlog
from fineslab.errors import EnvironmentSetupError

logger = logging.getLogger(__name__)

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_memory_monitor_refresh_ms": "0",
           "RAY_AUTH_MODE": "disabled"}
#: Ray's GCS marks a node dead after failure_threshold missed checks of period_ms each.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
OBJECT_STORE_BYTES = 80 << 20  # Ray's minimum is 75 MiB; fineslab passes no large objects


def node_resource(name: str) -> str:
    """The custom resource that names node `name` (one unit on that node only)."""
    return f"fineslab_node_{name}"


class LocalCluster:
    """Nodes `names` (the first is the head), each with `cpus_per_node` logical CPUs and its
    naming resource; the driver connected. `close()` stops every node and removes the temp
    folder; `kill(name)` SIGKILLs a node's processes as a lost machine would."""

    def __init__(self, names: Sequence[str], cpus_per_node: int = 1) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"node names must be distinct and at least one: {list(names)}")
        if "ray" in sys.modules and any(os.environ.get(k) != v for k, v in RAY_ENV.items()):
            raise EnvironmentSetupError(
                "LocalCluster sets Ray's environment (RAY_ENV) before ray is imported, and "
                "ray was imported first: create the cluster before importing ray, or set "
                f"{RAY_ENV} in the environment")
        os.environ.update(RAY_ENV)
        import ray
        from ray.cluster_utils import Cluster

        self._ray = ray
        self._cpus_per_node = cpus_per_node
        self.temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")
        # `Cluster` writes /tmp/ray/ray_current_cluster whatever temp_dir says, and fails when
        # the folder is missing; fineslab never reads it (explicit addresses only).
        os.makedirs("/tmp/ray", exist_ok=True)
        self.nodes: dict[str, Any] = {}
        self._cluster = Cluster()
        started = time.monotonic()
        startlog.record("begin", "ray-cluster", f"{len(names)} nodes")
        try:
            for index, name in enumerate(names):
                args: dict[str, Any] = {
                    "num_cpus": cpus_per_node, "resources": {node_resource(name): 1},
                    "node_ip_address": "127.0.0.1", "object_store_memory": OBJECT_STORE_BYTES,
                    "include_dashboard": False}
                if index == 0:
                    args |= {"temp_dir": self.temp_dir, "_system_config": FAST_HEALTH_CHECKS}
                self.nodes[name] = self._cluster.add_node(**args)
            self._cluster.wait_for_nodes()
            ray.init(address=self._cluster.address, logging_level=logging.WARNING,
                     log_to_driver=False)
        except BaseException:
            self.close()
            raise
        logger.info("local Ray cluster of %d node(s) up in %.1f s", len(names),
                    time.monotonic() - started)
        startlog.record("ready", "ray-cluster", f"{len(names)} nodes",
                        time.monotonic() - started)

    def add(self, name: str) -> None:
        """Start one more node `name` (a node that joins the running cluster)."""
        if name in self.nodes:
            raise ValueError(f"node {name} exists")
        self.nodes[name] = self._cluster.add_node(
            num_cpus=self._cpus_per_node, resources={node_resource(name): 1},
            node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False)
        self._cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    def node_id(self, name: str) -> str:
        return str(self.nodes[name].node_id)

    def kill(self, name: str) -> None:
        """SIGKILL node `name`'s Ray processes and reap them (a lost machine)."""
        node = self.nodes.pop(name)
        if node is self._cluster.head_node:
            raise EnvironmentSetupError("the head node cannot be killed: the cluster needs it")
        self._cluster.remove_node(node, allow_graceful=False)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._ray.is_initialized():
                self._ray.shutdown()
        with contextlib.suppress(Exception):
            self._cluster.shutdown()
        self.nodes = {}
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

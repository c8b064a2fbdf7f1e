"""The cluster fleet's watch: node loss, hung or exited node fleets, re-placement, joins.

    every WATCH_S            each agent's node fleets (fleet_status): a lost agent -> node lost;
                             an exited node fleet -> fleet lost; one that serves -> routes
    every probe_interval_s   each serving node router's /health (RouterProbes): hung after
                             probe_failures misses -> stopped (SIGKILL after HUNG_STOP_S), lost
    every JOIN_CHECK_S       Ray's live nodes: a new one gets an agent; models that fit nowhere
                             are placed again
    lost (node or fleet)     its routes go (requests there end at once, its models answer 503),
                             its models are placed on what the survivors have left
                             (fineslab.cluster.plan.place_on_residual) and started there as a
                             new node fleet beside the running ones

A mixin of `ClusterFleet` (driver.py), which owns the state it reads and the start-up steps it
calls again (`_start_share`, `_add_node`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fineslab.cluster.front import FrontRouter
from fineslab.cluster.node_table import (
    Node,
    NodeFleet,
    NodeTable,
    RouterProbes,
    alive_nodes,
    node_name,
)
from fineslab.cluster.plan import ClusterPlan, NodeDevices, place_on_residual
from fineslab.fleet.config import FleetConfig
from fineslab.scheduler.profile_schema import ModelProfile

logger = logging.getLogger(__name__)

#: How often the driver asks every agent for its node fleets.
WATCH_S = 0.5
#: How long one agent call may take before it counts as not answering (not as lost).
CALL_TIMEOUT_S = 10.0
#: How often the driver looks for nodes that joined.
JOIN_CHECK_S = 5.0
#: A node router that answers no `/health` within this is probed as not answering.
HUNG_PROBE_TIMEOUT_S = 5.0
#: A hung node fleet gets this long to stop before its process group is SIGKILLed.
HUNG_STOP_S = 5.0


class Watch:
    config: FleetConfig
    table: NodeTable
    front: FrontRouter | None
    profiles: dict[str, ModelProfile]
    progress: Callable[[str], None]
    probes: RouterProbes
    unplaced: list[str]
    replaced_s: float | None
    _replacing: tuple[float, set[str]] | None
    _stop: threading.Event

    def _statuses(self, node: Node) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def _start_share(self, plan: ClusterPlan) -> None:
        raise NotImplementedError

    def _add_node(self, info: dict[str, Any]) -> Node:
        raise NotImplementedError

    def _say_serving(self, node: Node, fleet: NodeFleet, status: dict[str, Any]) -> None:
        raise NotImplementedError

    def _publish_routes(self) -> None:
        raise NotImplementedError

    # -- watch ----------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        next_join = time.monotonic() + JOIN_CHECK_S
        while not self._stop.wait(WATCH_S):
            try:
                self._watch_once()
                if self.probes.due():
                    self._probe_routers()
                if time.monotonic() >= next_join:
                    next_join = time.monotonic() + JOIN_CHECK_S
                    self._look_for_joins()
            except Exception:  # the watch must outlive any one bad round
                logger.exception("cluster watch round failed")

    def _watch_once(self) -> None:
        from ray.exceptions import GetTimeoutError, RayActorError

        from fineslab.cluster.agent import is_lost

        changed = False
        for node in self.table.live():
            try:
                statuses = self._statuses(node)
            except RayActorError as exc:
                if is_lost(exc) and not self._stop.is_set():
                    self._node_lost(node, f"its agent is gone ({type(exc).__name__})")
                continue
            except GetTimeoutError:
                logger.warning("node %s: agent did not answer within %.0f s", node.name,
                               CALL_TIMEOUT_S)
                continue
            for name, status in statuses.items():
                fleet = node.fleets.get(name)
                if fleet is None or fleet.state == "exited":
                    continue
                if self.table.note(fleet, status):
                    changed = True
                    self._say_serving(node, fleet, status)
                elif status["state"] == "exited" and not self._stop.is_set():
                    self._fleet_lost(node, fleet, f"fleet {name} exited with {status.get('rc')}")
        if changed:
            self._publish_routes()
            self._check_replaced()

    def _probe_routers(self) -> None:
        """Stop and re-place the node fleets whose routers stopped answering."""
        import ray

        serving = {f.url: (n, f) for n in self.table.live() for f in n.fleets.values()
                   if f.state == "serving" and f.url}
        for url in self.probes.hung(list(serving)):
            node, fleet = serving[url]
            reason = (f"fleet {fleet.name}'s router {url} did not answer "
                      f"{self.probes.failures} probes (hung)")
            assert self.front is not None
            self.front.mark_node_lost(node.route_label(fleet.name), reason)
            try:
                ray.get(node.agent.stop_fleet.remote(fleet.name, HUNG_STOP_S),
                        timeout=HUNG_STOP_S + CALL_TIMEOUT_S * 3)
            except Exception as exc:  # its node may be going too; the watch sees that
                logger.warning("node %s: stopping hung fleet %s failed: %s", node.name,
                               fleet.name, exc)
            self._fleet_lost(node, fleet, reason)

    def _node_lost(self, node: Node, reason: str) -> None:
        with self.table.lock:
            fleets = [f for f in node.fleets.values() if f.active]
            node.lost = True
        self._lost(node, fleets, f"node {node.name} lost: {reason}", reason)

    def _fleet_lost(self, node: Node, fleet: NodeFleet, reason: str) -> None:
        fleet.state = "exited"
        self._lost(node, [fleet], f"node {node.name}: {reason}", reason)

    def _lost(self, node: Node, fleets: list[NodeFleet], what: str, reason: str) -> None:
        """`fleets` of `node` are gone: their routes go (requests there end now) and their
        models are placed again."""
        lost_at = time.monotonic()
        models = sorted({m for f in fleets for m in f.models})
        self.progress(f"{what}; re-placing {models}")
        assert self.front is not None
        for fleet in fleets:
            self.front.mark_node_lost(node.route_label(fleet.name), reason)
        self._publish_routes()
        self._replace(models, lost_at)

    def _replace(self, models: list[str], since: float) -> None:
        """Place `models` on what the live nodes have left and start them there."""
        assert self.front is not None
        models = [m for m in models if not self.table.placed(m)]
        if not models:
            return
        survivors = [NodeDevices(n.name, n.devices) for n in self.table.live()]
        plan, left = place_on_residual(self.config, survivors, self.table.used_bytes(), models,
                                       self.profiles)
        self.unplaced = sorted(set(self.unplaced) | set(left))
        if left:
            self.progress(f"models {left} fit on no surviving node; they answer 503 until a "
                          "node joins")
        if plan is not None:
            placed = [m for m in models if m not in left]
            self.front.mark_moving(placed)
            self._replacing = (since, set(placed))
            self.progress(plan.describe())
            self._start_share(plan)

    def _check_replaced(self) -> None:
        if self._replacing is None:
            return
        since, models = self._replacing
        if all(self.table.serving(model) for model in models):
            self.replaced_s = time.monotonic() - since
            self._replacing = None
            self.progress(f"re-placed {sorted(models)}: serving again {self.replaced_s:.1f} s "
                          "after the loss")

    def _look_for_joins(self) -> None:
        known = self.table.known_ids()
        for info in alive_nodes():
            if info["NodeID"] in known:
                continue
            try:
                node = self._add_node(info)
            except Exception as exc:  # a node that cannot take an agent is skipped, not fatal
                logger.warning("node %s joined but its agent did not start: %s",
                               node_name(info), exc)
                continue
            self.progress(f"node {node.name} joined; used at the next placement")
            if self.unplaced:
                waiting, self.unplaced = self.unplaced, []
                self._replace(waiting, time.monotonic())

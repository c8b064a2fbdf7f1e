"""The node agent: one Ray actor per node that runs that node's share of the fleet (issue #21).

    launcher (driver)                        node "a"
      spawn_agent("a") --------------------> NodeAgent("a")  (pinned to the node, no CPU slot)
      agent.devices(config) <--------------- the node's devices (`devices:` resolved there)
      agent.start_fleet(name, NodeSpec) ---> python -m fineslab.cluster.node_fleet  (own session)
                                               arenas, supervised SGLang runtimes, node router
      agent.fleet_status() <---------------- starting | serving (router URL) | exited (log tail)
      agent.close() -----------------------> every node fleet stopped, its arenas unlinked

A node fleet is a child process of the agent, in a session of its own, holding the read end of
a pipe whose write end only the agent has: when the agent goes, however it goes (its node lost,
`ray.kill`, SIGKILL; Ray kills the worker's process group, and `__ray_shutdown__` does not run
then), the node fleet reads EOF and stops cleanly, and if it is itself killed, its runtimes'
lifelines stop them (fineslab.lifeline). When its node dies, calls to the agent raise
`ray.exceptions.RayActorError` (`ActorUnavailableError`, a subclass, may come first and is
transient: `is_lost` tells the two apart).

The agent can also own bare arenas (`create_arena`, `snapshot`): what the first Ray test uses.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fineslab.cluster.node_fleet import NodeSpec
from fineslab.errors import ConfigError
from fineslab.fleet.config import DeviceConfig, FleetConfig
from fineslab.proctree import ProcessIdentity
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.inspector import as_dict
from fineslab.slabs.integrity import snapshot

logger = logging.getLogger(__name__)

#: How long a SIGKILLed node fleet may take to be gone before its leftovers are swept.
KILL_WAIT_S = 10.0


@dataclass
class _NodeFleet:
    """One node fleet and the files it reports through (fineslab.cluster.node_fleet). `starter` is
    the process the agent started, which forks the node fleet and exits: the fleet is no child
    of the agent's worker, whose direct children Ray SIGKILLs when the worker exits. Its
    process group (the starter's pid) is the fleet's."""

    name: str
    fleet_id: str
    starter: subprocess.Popen[bytes]
    stop_fd: int  # the write end the node fleet watches; closed to stop it
    work_dir: Path
    log_path: Path
    swept: bool = False

    def _read(self, name: str) -> Any:
        try:
            return json.loads((self.work_dir / name).read_text())
        except (OSError, ValueError):
            return None

    def identity(self) -> ProcessIdentity | None:
        pid = self._read("pid.json")
        return None if pid is None else ProcessIdentity(int(pid[0]), int(pid[1]))

    def running(self) -> bool:
        identity = self.identity()
        if identity is None:  # not forked yet, or the starter failed before the fork
            return self.starter.poll() in (None, 0)
        return identity.is_alive()

    def status(self) -> dict[str, Any]:
        state: dict[str, Any] = {"log": str(self.log_path)}
        identity = self.identity()
        if identity is not None:
            state["pid"] = identity.pid
        if not self.running():
            done = self._read("exit.json")
            rc = done["rc"] if done else ("killed" if identity else self.starter.poll())
            if done is None and identity is not None:
                self.sweep()
            return state | {"state": "exited", "rc": rc, "log_tail": _tail(self.log_path)}
        ready = self._read("ready.json")
        if ready is not None:
            return state | {"state": "serving", **ready}
        return state | {"state": "starting", "progress": _last_progress(self.log_path)}

    def stop(self, timeout_s: float) -> object:
        """Close the stop pipe and wait for the fleet's clean stop; SIGKILL its process group
        after `timeout_s`. Returns its exit status."""
        with contextlib.suppress(OSError):
            os.close(self.stop_fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.starter.wait(10)
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.running():
            logger.warning("node fleet %s did not stop within %.0f s; killing it", self.name,
                           timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.starter.pid, signal.SIGKILL)
            deadline = time.monotonic() + KILL_WAIT_S
            while self.running() and time.monotonic() < deadline:  # SIGKILL lands async
                time.sleep(0.05)
        done = self._read("exit.json")
        if done is None:
            self.sweep()
        return done["rc"] if done else "killed"

    def sweep(self) -> None:
        """What a killed node fleet left on this node (its runtimes' lifelines stop them and
        unlink its arenas; this removes the rest: its run record, folders, any straggler),
        once."""
        if self.swept or self.running():
            return
        from fineslab.fleet.leftovers import sweep
        from fineslab.slabs.arena import remove_dead_arenas

        try:
            sweep(self.fleet_id, progress=logger.info).remove()
            for table in remove_dead_arenas(self.fleet_id):
                logger.info("node fleet %s: removed its arena %s", self.name, table.name)
        except Exception as exc:  # tried again at the next status
            logger.warning("node fleet %s: sweeping what it left failed: %s", self.name, exc)
            return
        self.swept = True
        logger.warning("node fleet %s (%s) was killed; swept what it left", self.name,
                       self.fleet_id)


def _last_progress(path: Path) -> str:
    """The node launcher's last progress line (its log records, which start with a date,
    skipped)."""
    lines = [line for line in _tail(path, 40).splitlines()
             if line.strip() and not _LOG_RECORD.match(line)]
    return lines[-1] if lines else ""


_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d ")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class NodeAgent:
    """What runs inside the actor (plain Python: the tests also call it in process)."""

    def __init__(self, node_name: str, shm_dir: str | None = None) -> None:
        self.node_name = node_name
        self.shm_dir = shm_dir
        self.arenas: dict[str, SlabArena] = {}
        self.fleets: dict[str, _NodeFleet] = {}

    def describe(self) -> dict[str, Any]:
        """Node name, Ray node id and address (None outside Ray), pid, and its arenas."""
        node_id = address = None
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
                address = ray.util.get_node_ip_address()
        except ImportError:
            pass
        return {"node": self.node_name, "node_id": node_id, "address": address,
                "pid": os.getpid(), "devices": sorted(self.arenas),
                "fleets": sorted(self.fleets)}

    def devices(self, config: FleetConfig) -> tuple[DeviceConfig, ...]:
        """The fleet's `devices:` as this node resolves them (auto: its own GPUs or CPU)."""
        from fineslab.fleet.plan import resolve_devices

        return resolve_devices(config)

    def start_fleet(self, name: str, spec: NodeSpec, env: dict[str, str] | None = None,
                    ) -> dict[str, Any]:
        """Start node fleet `name` from `spec` (returns at once; `fleet_status` follows it).
        `env` is added to the node fleet's environment (the router's API key)."""
        if name in self.fleets and self.fleets[name].running():
            raise ConfigError(f"node {self.node_name}: fleet {name} is running")
        # named by the node fleet's id, so that `ps` shows which fleet a process serves
        work_dir = Path(tempfile.mkdtemp(prefix=f"fineslab-node-{spec.config.fleet_id}-"))
        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
        (work_dir / "spec.pickle").write_bytes(pickle.dumps(spec))
        log_path = Path(spec.log_dir) / "node-launcher.log"
        read_fd, write_fd = os.pipe()
        os.set_inheritable(write_fd, False)
        argv = [sys.executable, "-m", "fineslab.cluster.node_fleet", "--spec",
                str(work_dir / "spec.pickle"), "--work-dir", str(work_dir),
                "--stop-with-fd", str(read_fd), "--agent-pid", str(os.getpid())]
        try:
            with log_path.open("ab") as log:
                starter = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, pass_fds=(read_fd,),
                                           start_new_session=True,
                                           env={**os.environ, **(env or {})})
        except OSError:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.fleets[name] = _NodeFleet(name, spec.config.fleet_id, starter, write_fd, work_dir,
                                       log_path)
        logger.info("node %s: fleet %s started (group %d, log %s)", self.node_name, name,
                    starter.pid, log_path)
        return self.fleets[name].status()

    def fleet_status(self) -> dict[str, dict[str, Any]]:
        """Each node fleet's state: starting, serving (with its router URL) or exited."""
        return {name: fleet.status() for name, fleet in self.fleets.items()}

    def stop_fleet(self, name: str, timeout_s: float = 60.0) -> object:
        """Stop node fleet `name` (runtimes, router, arenas); its exit status."""
        fleet = self.fleets.pop(name, None)
        if fleet is None:
            return None
        rc = fleet.stop(timeout_s)
        shutil.rmtree(fleet.work_dir, ignore_errors=True)
        return rc

    def create_arena(self, spec: ArenaSpec) -> dict[str, Any]:
        """Create the arena of `spec.device` on this node; returns its snapshot."""
        if spec.device in self.arenas:
            raise ConfigError(f"node {self.node_name}: an arena for {spec.device} exists")
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

    def close(self, timeout_s: float = 60.0) -> dict[str, object]:
        """Stop every node fleet and unmap and unlink every arena of this node; the fleets'
        exit statuses."""
        stopped = {name: self.stop_fleet(name, timeout_s) for name in list(self.fleets)}
        for device in list(self.arenas):
            self.arenas.pop(device).close()
        return stopped


def spawn_agent(node_name: str, shm_dir: str | None = None, *, node_id: str | None = None,
                num_gpus: float = 0, actor_name: str | None = None) -> Any:
    """A `NodeAgent` actor on node `node_name` (Ray must be initialized): pinned to Ray node
    `node_id` when given (any cluster), else by the node's naming resource (`LocalCluster`).
    It takes no CPU slot and holds `num_gpus`: all of its node's GPUs, so that Ray schedules
    nothing else on them."""
    import ray

    options: dict[str, Any] = {"name": actor_name or f"fineslab-agent-{node_name}",
                               "num_cpus": 0, "num_gpus": num_gpus, "max_restarts": 0}
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    else:
        from fineslab.cluster.local import node_resource

        options["resources"] = {node_resource(node_name): 1}
    return ray.remote(NodeAgent).options(**options).remote(node_name, shm_dir)


def is_lost(error: BaseException) -> bool:
    """Whether `error` from a call to an agent says its actor is gone for good (its node or
    process died), not unavailable for a moment."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(error, RayActorError) and not isinstance(error, ActorUnavailableError)

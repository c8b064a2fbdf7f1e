"""Two Ray nodes on this machine, a node agent pinned to each (real Ray, real processes).

    node "a" (head)  NodeAgent("a") -> arena c<id>-a/cpu0 in /dev/shm (its own file)
    node "b"         NodeAgent("b") -> arena c<id>-b/cpu0

Each agent runs on its own node and owns its node's arena; a node that dies (SIGKILL of its
raylet and workers) takes its agent with it, the driver sees that as a lost actor within a few
seconds (fast health checks), and the other node's agent keeps answering; a clean stop leaves
no Ray process and no arena file.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from fineslab.slabs.arena import ArenaSpec
from fineslab.slabs.shm import ArenaPaths

pytestmark = pytest.mark.slow

SLAB_BYTES = 64 << 10
NUM_SLABS = 8


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        status = Path(f"/proc/{pid}/stat").read_text().split()[2] \
            if Path(f"/proc/{pid}/stat").exists() else "X"
        if status != "Z":
            alive.append(pid)
    return alive


def _children() -> list[int]:
    """PIDs of every live descendant of this process (the Ray nodes are its children)."""
    me, found = os.getpid(), []
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1]
                                               .split()[1])
            except (OSError, IndexError, ValueError):
                continue
    frontier = [me]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return _pids_alive(found)


def test_each_node_agent_owns_its_nodes_arena_and_a_lost_node_is_seen(tmp_path: Path) -> None:
    from fineslab.cluster.local import LocalCluster

    fleet = f"c{uuid.uuid4().hex[:8]}"
    before = set(_children())
    cluster = LocalCluster(["a", "b"])  # sets Ray's environment before ray is imported
    try:
        import ray

        from fineslab.cluster.agent import is_lost, spawn_agent

        agents = {name: spawn_agent(name, str(tmp_path)) for name in ("a", "b")}
        described = {name: ray.get(agent.describe.remote(), timeout=60)
                     for name, agent in agents.items()}
        for name in agents:
            assert described[name]["node_id"] == cluster.node_id(name), (
                f"agent {name} must run on node {name}: {described}")
        assert described["a"]["pid"] != described["b"]["pid"]
        for name, agent in agents.items():
            spec = ArenaSpec(f"{fleet}-{name}", "cpu0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 4)
            snap = ray.get(agent.create_arena.remote(spec), timeout=60)
            assert snap["num_slabs"] == NUM_SLABS and snap["free_bytes"] == NUM_SLABS * SLAB_BYTES
            assert ArenaPaths.of(spec.fleet_id, "cpu0", tmp_path).table.exists()
        with pytest.raises(ray.exceptions.RayTaskError, match="no arena for cuda0"):
            ray.get(agents["a"].snapshot.remote("cuda0"), timeout=60)

        cluster.kill("b")
        lost_at = time.monotonic()
        while True:
            try:
                ray.get(agents["b"].snapshot.remote("cpu0"), timeout=10)
            except ray.exceptions.RayActorError as error:
                if is_lost(error):
                    break
            except ray.exceptions.GetTimeoutError:
                pass
            assert time.monotonic() - lost_at < 30, "a lost node must be seen within 30 s"
            time.sleep(0.2)
        seen_s = time.monotonic() - lost_at
        survivor = ray.get(agents["a"].snapshot.remote("cpu0"), timeout=60)
        assert survivor["free_bytes"] == NUM_SLABS * SLAB_BYTES, "node a keeps serving"
        print(f"\nlost node seen after {seen_s:.1f} s")

        ray.get(agents["a"].close.remote(), timeout=60)
        assert not ArenaPaths.of(f"{fleet}-a", "cpu0", tmp_path).table.exists(), (
            "a clean close unlinks the node's arena")
        # On one machine the lost node's /dev/shm is this machine's: its creator is dead, so
        # the next create of that arena reclaims it; here the test removes it.
        ArenaPaths.of(f"{fleet}-b", "cpu0", tmp_path).unlink()
    finally:
        cluster.close()
    deadline = time.monotonic() + 30
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_children()) - before, "a closed cluster leaves no Ray process behind"
    assert not Path(cluster.temp_dir).exists()

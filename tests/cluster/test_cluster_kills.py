"""Kills at the worst moments of a cluster fleet: `python -m fineslab.launch --ray ADDRESS` as its
own process over two Ray nodes on this machine (real Ray, real SGLang runtimes, real HTTP).

1. SIGKILL of node b's node fleet (its launcher): its runtimes die with it (lifelines), its
   agent sweeps what it left, the driver sees it exited and places its model again where there
   is room (node b again: node a's memory is taken), and it answers again.

Each node's memory (0.02 GiB for the placer) holds one of the two models, so each node runs one.
2. SIGKILL of the launcher (the Ray driver): Ray ends its agents, each node fleet reads EOF on
   its stop pipe and stops cleanly: no runtime, arena or run record is left on any node.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SERVING_TIMEOUT_S = 240.0


def _fleet_yaml(tmp_path: Path, fleet_id: str) -> Path:
    data = {
        "fleet_id": fleet_id,
        "devices": [{"name": "cpu", "kind": "cpu", "memory_gib": 0.02, "kv_arena_mib": 16}],
        "router": {"host": "127.0.0.1", "port": 0},
        "models": [
            {"name": "tiny-a", "preset": "llama-tiny", "precision": "bf16", "ttft_slo_s": 5.0,
             "request_rate_per_s": 1.0},
            {"name": "tiny-b", "preset": "qwen2-tiny", "precision": "bf16", "ttft_slo_s": 5.0,
             "request_rate_per_s": 1.0}],
        "cluster": {"engine": "ray", "min_nodes": 2, "wait_nodes_s": 30}}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _read_until(stream: IO[str], pattern: str, deadline: float, seen: list[str]) -> re.Match[str]:
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no line matching {pattern!r}; the launcher said:\n{''.join(seen)}")


def _fleet_pids(fleet_id: str) -> list[int]:
    """Live processes whose command line or environment names this fleet."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            blob = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if fleet_id.encode() in blob:
            pids.append(int(entry.name))
    return pids


def _answers(base: str, model: str) -> bool:
    import httpx

    try:
        reply = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"model": model, "prompt": "Hi", "max_tokens": 2})
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and bool(reply.json()["choices"][0]["text"])


def test_a_killed_node_fleet_is_placed_again_and_a_killed_launcher_leaves_nothing(
        tmp_path: Path) -> None:
    from fineslab.cluster.local import LocalCluster

    fleet_id = f"k2n{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(["a", "b"])
    launcher = None
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "fineslab.launch", "--config",
             str(_fleet_yaml(tmp_path, fleet_id)), "--ray", cluster.address,
             "--log-dir", str(tmp_path / "logs")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        assert launcher.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + SERVING_TIMEOUT_S
        pids = {}
        for _ in range(2):
            found = _read_until(launcher.stdout, r"node (\w+): fleet g0 serving \['([\w-]+)'\] "
                                r"on \S+ \(node fleet pid (\d+)\)", deadline, seen)
            pids[found.group(1)] = (found.group(2), int(found.group(3)))
        base = _read_until(launcher.stdout, r"front router serving .* on (http://\S+)/v1",
                           deadline, seen).group(1)
        model_b, pid_b = pids["b"]
        assert _answers(base, model_b) and _answers(base, pids["a"][0])

        os.kill(pid_b, signal.SIGKILL)
        _read_until(launcher.stdout, rf"re-placed \['{model_b}'\]: serving again",
                    time.monotonic() + SERVING_TIMEOUT_S, seen)
        assert _answers(base, model_b), f"{model_b} answers after its node fleet was killed"
        assert _answers(base, pids["a"][0])
        assert _fleet_pids(fleet_id), "the fleet runs before the launcher is killed"

        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 90
        while _fleet_pids(fleet_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _fleet_pids(fleet_id), (
            "a killed launcher's node fleets stop: " + ", ".join(
                Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120]
                for p in _fleet_pids(fleet_id)))
        left = sorted(p.name for p in Path("/dev/shm").glob(f"*{fleet_id}*"))
        assert not left, f"no arena or run record is left on any node: {left}"
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()
        cluster.close()

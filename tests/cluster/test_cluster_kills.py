"""Kills at the worst moments of a cluster fleet: `python -m fineslab.launch --ray ADDRESS` as its
own process over two Ray nodes on this machine (real Ray, real SGLang runtimes, real HTTP).

1. SIGKILL of node b's node fleet (its launcher): its runtimes die with it (lifelines), its
   agent sweeps what it left, the driver sees it exited and places its model again where there
   is room (node b again: node a's memory is taken), and it answers again.

Each node's memory (0.02 GiB for the placer) holds one of the two models, so each node runs one.
2. SIGKILL of node b itself: node a has no room for b's model, which answers 503 with
   Retry-After; node c joins, gets an agent, and the model is placed there and answers.
   SIGSTOP of that node fleet: its router stops answering /health, the driver stops it
   (SIGKILL after 5 s) and places the model again.
3. SIGKILL of the launcher (the Ray driver): Ray ends its agents, each node fleet reads EOF on
   its stop pipe and stops cleanly: no runtime, arena or run record is left on any node.
All through the front router with the fleet's API key, which the node routers require too.
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
from typing import IO, Any

import pytest
import yaml
from cluster_support import fleet_pids

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SERVING_TIMEOUT_S = 240.0
KEY_ENV, KEY = "FINESLAB_TEST_CLUSTER_KEY", "cluster-test-key"


def _fleet_yaml(tmp_path: Path, fleet_id: str) -> Path:
    data = {
        "fleet_id": fleet_id,
        "devices": [{"name": "cpu", "kind": "cpu", "memory_gib": 0.02, "kv_arena_mib": 16}],
        "router": {"host": "127.0.0.1", "port": 0, "api_key_env": KEY_ENV},
        "models": [
            {"name": "tiny-a", "preset": "llama-tiny", "precision": "bf16", "ttft_slo_s": 5.0,
             "request_rate_per_s": 1.0},
            {"name": "tiny-b", "preset": "qwen2-tiny", "precision": "bf16", "ttft_slo_s": 5.0,
             "request_rate_per_s": 1.0}],
        "supervision": {"probe_interval_s": 2.0},
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


def _post(base: str, model: str, key: str | None = KEY) -> Any:
    import httpx

    return httpx.post(f"{base}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"} if key else {},
                      json={"model": model, "prompt": "Hi", "max_tokens": 2})


def _answers(base: str, model: str) -> bool:
    import httpx

    try:
        reply = _post(base, model)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and bool(reply.json()["choices"][0]["text"])


def test_killed_hung_or_lost_node_fleets_are_placed_again_and_a_killed_launcher_leaves_nothing(
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
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**os.environ, KEY_ENV: KEY})
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
        assert _post(base, model_b, key=None).status_code == 401
        assert _post(base, model_b, key="wrong").status_code == 401

        os.kill(pid_b, signal.SIGKILL)
        _read_until(launcher.stdout, rf"re-placed \['{model_b}'\]: serving again",
                    time.monotonic() + SERVING_TIMEOUT_S, seen)
        assert _answers(base, model_b), f"{model_b} answers after its node fleet was killed"
        assert _answers(base, pids["a"][0])

        cluster.kill("b")
        _read_until(launcher.stdout, rf"models \['{model_b}'\] fit on no surviving node",
                    time.monotonic() + 60, seen)
        waiting = _post(base, model_b)
        assert waiting.status_code == 503 and waiting.headers.get("retry-after"), waiting.text
        assert _answers(base, pids["a"][0]), "node a keeps serving while b's model waits"
        cluster.add("c")
        _read_until(launcher.stdout, r"node c joined", time.monotonic() + 180, seen)  # agent start
        on_c = _read_until(launcher.stdout, rf"node c: fleet g\d+ serving \['{model_b}'\] "
                           r"on \S+ \(node fleet pid (\d+)\)",
                           time.monotonic() + SERVING_TIMEOUT_S, seen)
        assert _answers(base, model_b), f"{model_b} answers from the node that joined"

        os.kill(int(on_c.group(1)), signal.SIGSTOP)  # its router hangs; its process lives
        stopped = time.monotonic()
        _read_until(launcher.stdout, r"router \S+ did not answer 2 probes \(hung\)",
                    time.monotonic() + 60, seen)
        assert time.monotonic() - stopped < 30, "a hung node fleet is seen within 30 s"
        _read_until(launcher.stdout, rf"re-placed \['{model_b}'\]: serving again",
                    time.monotonic() + SERVING_TIMEOUT_S, seen)
        assert _answers(base, model_b), f"{model_b} answers after its node fleet hung"
        assert fleet_pids(fleet_id), "the fleet runs before the launcher is killed"

        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 90
        while fleet_pids(fleet_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not fleet_pids(fleet_id), (
            "a killed launcher's node fleets stop: " + ", ".join(
                Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120]
                for p in fleet_pids(fleet_id)))
        left = sorted(p.name for p in Path("/dev/shm").glob(f"*{fleet_id}*"))
        assert not left, f"no arena or run record is left on any node: {left}"
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()
        cluster.close()

"""Benchmark: the CPU demo fleet over a two-node Ray cluster on this machine.

    python -m fineslab.bench.cluster [--json] [--requests 200] [--config examples/cpu-demo.yaml]

Two Ray nodes ("a", the head, and "b") on this machine (`fineslab.cluster.local`), the fleet
placed over both by its placer, each node's share run by its agent, the front router in this
process. Measured, in one run:
    ready_s              launch (cluster up) to every model serving through the front router
    front_router_p50_ms, front_router_p99_ms
                         what the front hop adds to one-token completions sent one at a time,
                         alternately through the front router and straight to the node router
                         that serves the model: p50(front) - p50(direct), p99(front) -
                         p99(direct) (`fineslab.bench.router`'s definition for the node router)
    front_router_pairwise_p50_ms, front_router_pairwise_p99_ms
                         the same requests, percentiles of the pairwise differences (front minus
                         the direct request sent right after it): SGLang's own step-to-step
                         jitter on 2 cores lands in these tails
    front_hop_p50_ms, front_hop_p99_ms
                         the hop alone, no runtime involved: a request the node router refuses
                         (400, max_tokens 0), through the front and directly, added p50/p99 as
                         above
    replace_s            node b SIGKILLed (its raylet reaped, as a lost machine) to its models
                         serving again on node a
    all_served           every model answered through the front router before the loss and
                         after the re-placement
What an operator sees during the loss, in the same run:
    metrics_by_node      the front's /metrics label each node's series (node="a", node="b")
    lost_stream          a long streamed completion at node b when it is lost: whether it had
                         started, how it ended ("finished", or "error: ..." as the client saw
                         it) and `ended_s` after the loss
    replacing_status, replacing_retry_after, replacing_error_clean, replacing_served
                         a completion for a lost model sent once the stream at the lost node
                         ended: its status (502 or 503 while it is re-placed; 200 if its new
                         runtime is already up), its Retry-After, whether its body is the
                         router's error shape with no traceback, and whether a 200 held a
                         completion
    survivor_served_while_replacing
                         node a's model answering while node b's are re-placed
    fleet_id, ray_temp_dir
                         what a clean stop must leave nothing of (tests/serving/
                         test_documented_benches.py looks)
Results in docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from fineslab.bench.router import percentile
from fineslab.tables import add_json_flag, emit

REPO = Path(__file__).resolve().parents[2]
SERVING_TIMEOUT_S = 300.0


def _complete(client: Any, url: str, model: str, max_tokens: int = 1) -> float:
    """Milliseconds for one completion request; a 400 expected when `max_tokens` is 0."""
    started = time.perf_counter()
    reply = client.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hi",
                                                       "max_tokens": max_tokens})
    if reply.status_code != (200 if max_tokens else 400):
        reply.raise_for_status()
        raise AssertionError(f"{url}: expected a 400 for max_tokens 0, got {reply.status_code}")
    return (time.perf_counter() - started) * 1000


def _added(client: Any, front: str, direct: str, model: str, requests: int,
           max_tokens: int) -> tuple[list[float], list[float]]:
    """Latencies (ms) of `requests` alternating pairs: through the front, then directly."""
    _complete(client, front, model, max_tokens)  # warm both paths
    _complete(client, direct, model, max_tokens)
    via, straight = [], []
    for _ in range(requests):
        via.append(_complete(client, front, model, max_tokens))
        straight.append(_complete(client, direct, model, max_tokens))
    return via, straight


def _serves(client: Any, url: str, model: str) -> bool:
    reply = client.post(f"{url}/v1/completions",
                        json={"model": model, "prompt": "Hello", "max_tokens": 2})
    return bool(reply.status_code == 200 and reply.json()["choices"][0]["text"])


def _stream(front: str, model: str, ended: dict[str, Any]) -> None:
    """A long streamed completion through the front router; `ended` gets when its first
    event came ("first"), how it ended ("outcome": "finished" after [DONE], else "error: ...")
    and when ("at")."""
    import httpx

    # ignore_eos: a random-weight model may end its stream in a few tokens, before the loss
    body = {"model": model, "prompt": "Count: one two", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    outcome = "error: the stream ended without [DONE]"
    try:
        with httpx.stream("POST", f"{front}/v1/completions", json=body, timeout=120) as reply:
            if reply.status_code != 200:
                outcome = f"error: HTTP {reply.status_code}"
            for line in reply.iter_lines() if reply.status_code == 200 else ():
                if not line.startswith("data:"):
                    continue
                ended.setdefault("first", time.monotonic())
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    outcome = "finished"
                    break
                if '"error"' in data:
                    outcome = f"error: {data[:300]}"
                    break
    except httpx.HTTPError as exc:
        outcome = f"error: {type(exc).__name__}: {exc}"
    ended["outcome"], ended["at"] = outcome, time.monotonic()


def _lose_node_b(client: Any, cluster: Any, front: str, on_a: list[str], on_b: list[str],
                 ) -> tuple[float, dict[str, Any]]:
    """Node b SIGKILLed with a stream in flight there; what the clients saw (module doc)."""
    ended: dict[str, Any] = {}
    streamer = threading.Thread(target=_stream, args=(front, on_b[0], ended), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 60
    while "first" not in ended and streamer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.kill("b")
    lost = time.monotonic()
    streamer.join(60)
    moving = client.post(f"{front}/v1/completions",
                         json={"model": on_b[-1], "prompt": "hi", "max_tokens": 2})
    try:
        answer = moving.json()
        clean = "error" in answer and "Traceback" not in moving.text
        served = moving.status_code == 200 and bool(answer.get("choices"))
    except ValueError:
        clean = served = False
    return lost, {
        "lost_stream": {"started": "first" in ended, "outcome": ended.get("outcome"),
                        "ended_s": round(ended["at"] - lost, 2) if "at" in ended else None},
        "replacing_status": moving.status_code,
        "replacing_retry_after": moving.headers.get("retry-after"),
        "replacing_error_clean": clean,
        # re-placed already (its new runtime up before the stream at the lost node ended)
        "replacing_served": served,
        "survivor_served_while_replacing": _serves(client, front, on_a[0])}


def run(config_path: Path, requests: int) -> dict[str, Any]:
    import httpx

    from fineslab.cluster.local import LocalCluster
    from fineslab.fleet.config import fleet_from_dict

    data = yaml.safe_load(config_path.read_text())
    data["fleet_id"] = f"bench-cluster-{uuid.uuid4().hex[:6]}"
    data["router"]["port"] = 0
    data["devices"] = [{**d, "memory_gib": d.get("memory_gib", 0.5)}
                       for d in data.get("devices") or
                       [{"name": "cpu", "kind": "cpu", "kv_arena_mib": 16}]]
    data["cluster"] = {"engine": "ray", "min_nodes": 2, "wait_nodes_s": 30}
    config = fleet_from_dict(data, str(config_path), config_path.parent)
    cluster = LocalCluster(["a", "b"])
    from fineslab.cluster.driver import ClusterFleet

    logs = tempfile.TemporaryDirectory(prefix="fineslab-bench-cluster-")
    fleet = ClusterFleet(config, port=0, log_dir=logs.name,
                         progress=lambda m: print(m, file=sys.stderr), address=cluster.address)
    result: dict[str, Any] = {"nodes": 2, "requests": requests, "fleet_id": config.fleet_id,
                              "ray_temp_dir": cluster.temp_dir}
    try:
        started = time.monotonic()
        fleet.start()
        result["ready_s"] = round(time.monotonic() - started, 2)
        assert fleet.plan is not None and fleet.server is not None
        front = fleet.server.base_url
        on_a, on_b = fleet.plan.models_on("a"), fleet.plan.models_on("b")
        direct = {m: f.url for n in fleet.table.nodes.values() for f in n.fleets.values()
                  for m in f.models}
        with httpx.Client(timeout=120) as client:
            served_before = all(_serves(client, front, m) for m in on_a + on_b)
            model = on_a[0]
            via, straight = _added(client, front, str(direct[model]), model, requests, 1)
            pairs = [v - s for v, s in zip(via, straight, strict=True)]
            result |= {
                "front_router_p50_ms": round(statistics.median(via) - statistics.median(straight),
                                             2),
                "front_router_p99_ms": round(percentile(via, 0.99) - percentile(straight, 0.99),
                                             2),
                "front_router_pairwise_p50_ms": round(statistics.median(pairs), 2),
                "front_router_pairwise_p99_ms": round(percentile(pairs, 0.99), 2),
                "direct_p50_ms": round(statistics.median(straight), 2),
                "direct_p99_ms": round(percentile(straight, 0.99), 2)}
            via, straight = _added(client, front, str(direct[model]), model, requests, 0)
            result["front_hop_p50_ms"] = round(statistics.median(via)
                                               - statistics.median(straight), 2)
            result["front_hop_p99_ms"] = round(percentile(via, 0.99)
                                               - percentile(straight, 0.99), 2)
            metrics = client.get(f"{front}/metrics").text
            result["metrics_by_node"] = 'node="a"' in metrics and 'node="b"' in metrics
            lost, seen = _lose_node_b(client, cluster, front, on_a, on_b)
            result |= seen
            deadline = lost + SERVING_TIMEOUT_S
            while time.monotonic() < deadline and fleet.replaced_s is None:
                time.sleep(0.2)
            result["replace_s"] = None if fleet.replaced_s is None else round(
                fleet.replaced_s, 2)
            served_after = all(_serves(client, front, m) for m in on_a + on_b)
        result["models_on_a"], result["models_on_b"] = on_a, on_b
        result["all_served"] = bool(served_before and served_after)
    finally:
        fleet.stop()
        cluster.close()
        logs.cleanup()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.cluster",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "cpu-demo.yaml")
    parser.add_argument("--requests", type=int, default=200,
                        help="request pairs for the front hop's added latency")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("FINESLAB_LOG_LEVEL", "WARNING"))
    result = run(args.config, max(2, args.requests))
    rows = [[k, json.dumps(v) if isinstance(v, (list, dict)) else v]
            for k, v in sorted(result.items())]
    emit("two-node CPU cluster (fineslab.bench.cluster)", ["figure", "value"], rows, result,
         args.json)
    return 0 if result.get("all_served") else 1


if __name__ == "__main__":
    sys.exit(main())

"""Router overhead: latency the router adds per request, against the same backend directly.

    python -m fineslab.bench.router [--rate 200] [--duration-s 10] [--with-sglang] [--json]

Setup (every part a separate process, so the load generator does not share a GIL with them):
the echo backend (`fineslab.router.testing`, a fast OpenAI-compatible server; a real SGLang
tiny model on 2 CPU cores cannot serve 200 requests/s), a router in front of it
(`python -m fineslab.router`), and an open-loop Poisson load generator (aiohttp) here. Each
arrival goes to the router or straight to the backend, alternately, so both paths see the same
load in the same run; the backend serves `--rate` requests/s through each path.

    added p50 = p50(via router) - p50(direct),   added p99 = p99(via router) - p99(direct)

in each of `--repeats` windows of `--duration-s`; reported: the median over the windows, with
its spread (`p50_ms_spread`, `p99_ms_spread`: median, min, max, n).

Latency is send -> whole response (non-streaming, 4 tokens). `--with-sglang` also measures the
added latency in front of one real SGLang runtime (llama-tiny on CPU) at a rate it sustains
(`--sglang-rate`, default 2 requests/s), keys `sglang_p50_ms`, `sglang_p99_ms`.
JSON keys: p50_ms, p99_ms (added, echo backend), and the raw percentiles of each path.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fineslab.bench.repeats import spread
from fineslab.connections import pooled_connector
from fineslab.router.testing import start_echo_backend
from fineslab.runtime import free_port, wait_until_up
from fineslab.tables import add_json_flag, emit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PathLatency:
    p50_ms: float
    p99_ms: float
    num_ok: int
    num_failed: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def start_router(port: int, routes: list[str], timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "fineslab.router", "--port", str(port), "--ttft-slo-s", "60"]
    for route in routes:
        argv += ["--route", route]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    wait_until_up(proc, f"http://127.0.0.1:{port}/health", "router", timeout_s)
    return proc


async def run_load(urls: dict[str, str], model: str, rate_per_s: float, duration_s: float,
                   max_tokens: int, seed: int = 0) -> dict[str, PathLatency]:
    """Open-loop Poisson arrivals at `rate_per_s` per path, alternating between the paths."""
    import aiohttp

    rng = random.Random(seed)
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    failed = dict.fromkeys(urls, 0)
    body = {"model": model, "prompt": "hello router", "max_tokens": max_tokens,
            "temperature": 0}
    names = list(urls)
    async with aiohttp.ClientSession(connector=pooled_connector()) as session:
        async def one(name: str) -> None:
            start_s = time.perf_counter()
            try:
                async with session.post(urls[name] + "/v1/completions", json=body) as reply:
                    await reply.read()
                    ok = reply.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies[name].append(time.perf_counter() - start_s)
            else:
                failed[name] += 1

        tasks = []
        next_s = time.perf_counter()
        end_s = next_s + duration_s
        i = 0
        while next_s < end_s:
            await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one(names[i % len(names)])))
            i += 1
            next_s += rng.expovariate(rate_per_s * len(names))
        await asyncio.gather(*tasks)
    return {name: PathLatency(percentile(v, 0.5) * 1e3, percentile(v, 0.99) * 1e3, len(v),
                              failed[name]) for name, v in latencies.items()}


def measure_echo(rate_per_s: float, duration_s: float, repeats: int = 1
                 ) -> list[dict[str, PathLatency]]:
    backend_port, router_port = free_port(), free_port()
    backend = start_echo_backend(backend_port)
    try:
        router = start_router(router_port, [f"echo=http://127.0.0.1:{backend_port}"])
        try:
            urls = {"router": f"http://127.0.0.1:{router_port}",
                    "direct": f"http://127.0.0.1:{backend_port}"}
            asyncio.run(run_load(urls, "echo", rate_per_s, 1.0, 4))  # warm-up
            return [asyncio.run(run_load(urls, "echo", rate_per_s, duration_s, 4, seed=window))
                    for window in range(repeats)]
        finally:
            router.terminate()
            router.wait(10)
    finally:
        backend.terminate()
        backend.wait(10)


def measure_sglang(rate_per_s: float, duration_s: float) -> dict[str, PathLatency]:
    from fineslab.env import FineslabEnv
    from fineslab.models.generate import ensure_model
    from fineslab.runtime import ServerSpec, start_server

    model_dir = ensure_model("llama-tiny", FineslabEnv.from_environ().model_cache_dir)
    spec = ServerSpec(str(model_dir), free_port(), extra_args=(
        "--served-model-name", "tiny", "--max-total-tokens", "4096"))
    with start_server(spec, Path("/tmp") / f"fineslab-bench-router-{spec.port}.log",
                      600) as backend:
        router_port = free_port()
        router = start_router(router_port, [f"tiny={backend.spec.base_url}"])
        try:
            urls = {"router": f"http://127.0.0.1:{router_port}", "direct": backend.spec.base_url}
            asyncio.run(run_load(urls, "tiny", rate_per_s, 2.0, 8))  # warm-up
            return asyncio.run(run_load(urls, "tiny", rate_per_s, duration_s, 8))
        finally:
            router.terminate()
            router.wait(10)


def _rows(label: str, paths: dict[str, PathLatency]) -> list[list[object]]:
    return [[label, name, p.num_ok, p.num_failed, p.p50_ms, p.p99_ms]
            for name, p in paths.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s on each path")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds of each window")
    parser.add_argument("--repeats", type=int, default=3,
                        help="windows of load (the added latency: their median and spread)")
    parser.add_argument("--with-sglang", action="store_true")
    parser.add_argument("--sglang-rate", type=float, default=2.0)
    parser.add_argument("--sglang-duration-s", type=float, default=20.0)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    windows = measure_echo(args.rate, args.duration_s, args.repeats)
    added = {q: spread([getattr(w["router"], f"{q}_ms") - getattr(w["direct"], f"{q}_ms")
                        for w in windows]) for q in ("p50", "p99")}
    paths = {(name, q): statistics.median(getattr(w[name], f"{q}_ms") for w in windows)
             for name in ("router", "direct") for q in ("p50", "p99")}
    result: dict[str, object] = {
        "p50_ms": added["p50"]["median"], "p99_ms": added["p99"]["median"],
        "p50_ms_spread": added["p50"], "p99_ms_spread": added["p99"],
        "rate_per_s": args.rate, "duration_s": args.duration_s, "repeats": args.repeats,
        "router_p50_ms": paths["router", "p50"], "router_p99_ms": paths["router", "p99"],
        "direct_p50_ms": paths["direct", "p50"], "direct_p99_ms": paths["direct", "p99"],
        "failed": sum(w["router"].num_failed + w["direct"].num_failed for w in windows),
    }
    rows = [row for i, w in enumerate(windows)
            for row in _rows(f"echo @ {args.rate:g}/s, window {i + 1}", w)]
    if args.with_sglang:
        sgl = measure_sglang(args.sglang_rate, args.sglang_duration_s)
        result.update({"sglang_p50_ms": sgl["router"].p50_ms - sgl["direct"].p50_ms,
                       "sglang_p99_ms": sgl["router"].p99_ms - sgl["direct"].p99_ms,
                       "sglang_rate_per_s": args.sglang_rate})
        rows += _rows(f"sglang @ {args.sglang_rate:g}/s", sgl)
    emit(f"router overhead: added p50 {result['p50_ms']:.2f} ms "
         f"({added['p50']['min']:.2f} to {added['p50']['max']:.2f}), p99 "
         f"{result['p99_ms']:.2f} ms ({added['p99']['min']:.2f} to {added['p99']['max']:.2f}), "
         f"median of {args.repeats} windows",
         ["backend", "path", "ok", "failed", "p50_ms", "p99_ms"], rows, result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

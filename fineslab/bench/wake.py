"""Sleep and wake of one model against a cold start and memcpy (issue #16).

`python -m fineslab.bench.wake --json [--size bench|tiny] [--cycles N]`

One runtime of a generated Llama (default `bench`: about 300 MB of bf16 weights, so that the
copy dominates; `tiny` is llama-tiny, for the short CI version) keeps its weights in a CPU
arena this benchmark creates. In one run, on this machine:

    cold_start_s   a fresh SGLang server of the same model (same arena set-up) from its start
                   to its first token: what a system without sleep pays to bring a model back
    memcpy_gib_s   a plain copy of a weights-sized resident buffer: the limit (the best of 3
                   copies before the server starts and 3 after it stops: a busy moment of the
                   machine must not lower the bar)
    sleep_s        /pause_generation (retract) + /release_memory_occupation (weights,
                   kv_cache), over HTTP, median of the cycles after the first (the first also
                   writes the host copy: sleep_first_s)
    wake_s         /resume_memory_occupation + /continue_generation, median over the cycles;
                   wake_gib_s = weights_gib / wake_s (what a client waits); the two calls
                   apart: resume_call_s (it holds restore_s) and continue_call_s
    restore_s      inside the runtime: slabs taken and mapped, weights read in (from its log);
                   restore_gib_s = weights_gib / restore_s (the mechanism; wake_s adds SGLang's
                   control path: four HTTP calls through its tokenizer and scheduler loops)
    identical      greedy output after every wake equals the output before the first sleep
    shm_huge       the huge-page setting of /dev/shm's mount ("never" by default; with
                   "advise" the arena gets 2 MiB pages and a wake skips most page-table work:
                   docs/elastic.md)
    cold_over_wake cold_start_s / wake_s
    *_spread       median, min, max and n over the cycles (of wake_s, sleep_s, restore_s, and of
                   cold_over_wake with each cycle's wake: one cold start, each a server's start)

Targets: cold_over_wake >= 20, wake_gib_s >= 0.5 * memcpy_gib_s, identical true.
`--corrupt-host-copy` flips bytes of the host copy before the last wake (the negative control
of `identical`: `identical_per_cycle` ends in false). `--skip-cold` leaves out the cold start.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch

from fineslab.bench.repeats import spread
from fineslab.env import FineslabEnv
from fineslab.models.generate import ensure_model
from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin.config import ArenaJoin
from fineslab.slabs import ArenaSpec, SlabArena
from fineslab.slabs.shm import shm_huge_pages
from fineslab.slabs.streamctl import host_copy_path
from fineslab.tables import add_json_flag, emit

#: The `bench` model: hidden 1024, 12 layers, MLP 2816, vocab 8192: about 150 M parameters.
SIZES: dict[str, tuple[str, dict[str, object]]] = {
    "bench": ("llama-small", {"hidden_size": 1024, "intermediate_size": 2816, "num_layers": 12,
                              "num_heads": 16, "num_kv_heads": 4, "vocab_size": 8192}),
    "tiny": ("llama-tiny", {}),
}
SLAB_BYTES = 2 << 20
KV_SLABS = 16
TAGS: dict[str, object] = {"tags": ["weights", "kv_cache"]}
PROMPT = list(range(10, 42))
NEW_TOKENS = 8


def timed_post(client: httpx.Client, path: str, body: dict[str, object],
               timeout_s: float = 600.0) -> float:
    """Seconds of one control call to a runtime (its sleep or wake endpoints); RuntimeError
    unless it answers 200."""
    start_s = time.perf_counter()
    reply = client.post(path, json=body, timeout=timeout_s)
    if reply.status_code != 200:
        raise RuntimeError(f"{path}: {reply.status_code} {reply.text[:300]}")
    return time.perf_counter() - start_s


def _greedy(base_url: str, new_tokens: int = NEW_TOKENS) -> list[int]:
    reply = httpx.post(base_url + "/generate", timeout=600, json={
        "input_ids": PROMPT, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    reply.raise_for_status()
    return list(reply.json()["output_ids"])


def memcpy_gib_s(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        start_s = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start_s)
    return nbytes / best / 2**30


def _server(model: Path, join: ArenaJoin, logs: Path, name: str) -> ServerProcess:
    spec = ServerSpec(str(model), free_port(), extra_args=(
        "--dtype", "bfloat16", "--page-size", "16", "--log-level", "info"),
        env=join.environ())
    return ServerProcess(spec, logs / f"{name}.log")


def run(size: str, cycles: int, corrupt: bool, logs: Path, cold: bool = True
        ) -> dict[str, object]:
    preset, overrides = SIZES[size]
    model = ensure_model(preset, FineslabEnv.from_environ().model_cache_dir, **overrides)
    weights_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    num_slabs = 2 * -(-weights_bytes // SLAB_BYTES) + KV_SLABS  # room for two copies
    spec = ArenaSpec(f"wake{uuid.uuid4().hex[:8]}", "cpu:0", num_slabs * SLAB_BYTES,
                     SLAB_BYTES, 4096)
    result: dict[str, object] = {"model": model.name, "shm_huge": shm_huge_pages()}
    memcpy_before = memcpy_gib_s(weights_bytes)
    with SlabArena.create(spec) as arena:
        join = ArenaJoin(spec.fleet_id, "m", weights_in_arena=True)
        if cold:
            result["cold_start_s"] = _cold_start(model, spec.fleet_id, logs)
            arena.table.reclaim_dead_owners()
        server = _server(model, join, logs, "m")
        try:
            server.wait_healthy(600)
            url = server.spec.base_url
            before = _greedy(url)
            region_bytes = _weight_bytes(arena)
            sleeps, wakes, same = [], [], []
            resumes: list[float] = []
            continues: list[float] = []
            # One connection for the control calls, as the router keeps one per runtime: a new
            # client per call cost 34-39 ms here (a keep-alive call 1.4-2.3 ms), which the first
            # runs of this benchmark counted as SGLang's control path.
            with httpx.Client(base_url=url) as client:
                for cycle in range(cycles):
                    sleeps.append(timed_post(client, "/pause_generation", {"mode": "retract"})
                                  + timed_post(client, "/release_memory_occupation", TAGS))
                    if corrupt and cycle == cycles - 1:
                        _corrupt(host_copy_path(spec.fleet_id, "m"))
                    resumes.append(timed_post(client, "/resume_memory_occupation", TAGS))
                    continues.append(timed_post(client, "/continue_generation", {}))
                    wakes.append(resumes[-1] + continues[-1])
                    same.append(_greedy(url) == before)
            restores = _restore_seconds(server.log_tail(100_000))
        finally:
            server.stop()
            host_copy_path(spec.fleet_id, "m").unlink(missing_ok=True)
    wake_s = statistics.median(wakes)
    gib = region_bytes / 2**30
    result.update(
        weights_gib=gib, sleep_first_s=sleeps[0],
        sleep_s=statistics.median(sleeps[1:] or sleeps), wake_s=wake_s,
        wake_gib_s=gib / wake_s, memcpy_gib_s=max(memcpy_before, memcpy_gib_s(region_bytes)),
        identical=all(same), identical_per_cycle=same, cycles=cycles,
        resume_call_s=statistics.median(resumes), continue_call_s=statistics.median(continues))
    result.update(wake_s_spread=spread(wakes, 4), sleep_s_spread=spread(sleeps[1:] or sleeps, 4))
    if len(restores) == cycles:
        result["restore_s"] = statistics.median(restores)
        result["restore_gib_s"] = gib / result["restore_s"]  # type: ignore[operator]
        result["restore_s_spread"] = spread(restores, 4)
    if cold:
        cold_s = float(result["cold_start_s"])  # type: ignore[arg-type]
        result["cold_over_wake"] = cold_s / wake_s
        # one cold start (seconds of the machine each) over each cycle's wake
        result["cold_over_wake_spread"] = spread([cold_s / w for w in wakes])
    result["wake_over_memcpy"] = float(result["wake_gib_s"]) / float(  # type: ignore[arg-type]
        result["memcpy_gib_s"])  # type: ignore[arg-type]
    return result


def _cold_start(model: Path, fleet_id: str, logs: Path) -> float:
    """Seconds from a fresh server's start to its first token (same arena set-up)."""
    server = _server(model, ArenaJoin(fleet_id, "cold", weights_in_arena=True), logs, "cold")
    start_s = time.perf_counter()
    try:
        server.wait_healthy(600)
        _greedy(server.spec.base_url, 1)
        return time.perf_counter() - start_s
    finally:
        server.stop()


def _restore_seconds(log: str) -> list[float]:
    """The runtime's own wake times (slabs mapped and weights read in), from its log."""
    return [float(m) for m in re.findall(r"weights of 'm' awake: .* in ([0-9.]+) s", log)]


def _weight_bytes(arena: SlabArena) -> int:
    from fineslab.slabs import snapshot

    owners = {o.runtime_id: o for o in snapshot(arena.table).owners if o.alive}
    return owners["m:w"].num_slabs * SLAB_BYTES


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), 4096):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.wake",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles (>= 1)")
    parser.add_argument("--skip-cold", action="store_true",
                        help="no cold start (the short CI version): no cold_over_wake")
    parser.add_argument("--corrupt-host-copy", action="store_true",
                        help="negative control: identical must come out false")
    parser.add_argument("--logs", type=Path,
                        default=Path(tempfile.gettempdir()) / "fineslab-bench-wake")
    add_json_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.cycles < 1:
        raise SystemExit("--cycles must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop servers
    args.logs.mkdir(parents=True, exist_ok=True)
    result = run(args.size, args.cycles, args.corrupt_host_copy, args.logs,
                 cold=not args.skip_cold)
    keys = ("weights_gib", "cold_start_s", "sleep_first_s", "sleep_s", "wake_s", "wake_gib_s",
            "restore_s", "restore_gib_s", "memcpy_gib_s", "cold_over_wake", "identical")
    emit(f"Sleep and wake, {result['model']}, {args.cycles} cycle(s), CPU arena",
         ["figure", "value"], [[k, result.get(k, "n/a")] for k in keys], result, args.json)


if __name__ == "__main__":
    main()

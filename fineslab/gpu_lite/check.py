"""The staged device check: SGLang through fineslab on the lent GPU, one stage at a time.

    python -m fineslab.gpu_lite.check [--out DIR] [--device cuda|cpu] [--stages a,b,...]
                                      [--stage-timeout-s S]

Each stage runs in a child process of its own, bounded by `--stage-timeout-s`, its output in
`DIR/<stage>.log` and its figures in `DIR/<stage>.json`; a stage that fails or times out never
stops the next (a short loan gets every answer it can). The last line of stdout is a JSON object:
per stage `ok`, `seconds` and its figures (or `error`).

Stages (`STAGES`):
    env        what runs: torch and its CUDA device, triton, SGLang and which `sgl_kernel` (the
               real one or fineslab's stand-in), fineslab's plugin entry point
    stock      SGLang's own KV pool serves llama-tiny and qwen2-tiny (greedy, 8 tokens for three
               prompts each), at page sizes 1 and 16 for llama-tiny
    slab-pool  the same requests with fineslab's SlabKVPool over an arena on the device, at page
               sizes 1 and 16: the runtime registered in the arena's table, and greedy output
               identical to the stock pool's of the same page size in this run
    sharing    llama-tiny and qwen2-tiny in one arena on the device, both serving; qwen2-tiny
               SIGKILLed with a request in flight: its slabs reclaimed, the table whole
               (check_integrity), llama-tiny answering as before
    weights    llama-tiny's weights in the arena (on CUDA built there by SGLang's loader, host
               copy pinned): identical to the stock pool, asleep and awake twice through
               SGLang's release/resume endpoints, identical after; wake GiB/s against the link
               (fineslab/gpu_lite/stage_weights.py)
    streaming  llama-tiny streaming layers 1 and 3 through one slot (StreamCopies on CUDA,
               SyncCopies on CPU): identical to the unstreamed run, the arena richer by the
               bytes lent, the overlap of copies and compute (stage_weights.py)
    precisions FP8 W8A8, AWQ W4A16, the KV4 decode kernel and the QoQ W4A8 Triton GEMM against
               their CPU references, each with a control it must catch; SGLang serving AWQ and
               (CUDA) FP8 W8A8KV8 within their gates (`stage_kernels.py`)
    bench      bench.alloc (quick) and bench.pool's slab-pool-against-stock decode comparison
               on the gpu-lite runtime (`stage_kernels.py`)

`--device cpu` runs the same stages on this machine's CPU mode: the rehearsal of the harness
that CI runs (tests/test_gpu_lite_check.py), so that a lent GPU's minutes go to the GPU.
On CUDA the runtimes take SGLang's triton attention backend, torch sampling, no CUDA graphs and
no grammar backend (`CUDA_ARGS`, and no grammar backend on either device): the gpu-lite path
(docs/gpu.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from fineslab.gpu_lite import stage_weights
from fineslab.gpu_lite.runtime_args import CUDA_ARGS
from fineslab.gpu_lite.stage_kernels import stage_bench, stage_precisions
from fineslab.proctree import stop_group

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ([11, 250, 37, 999, 4, 512, 77, 1200, 31, 8], [5, 6, 7, 8, 9, 10], [300, 2, 45, 77])
NEW_TOKENS = 8
SLAB_BYTES = 1 << 21
ARENA_SLABS = 32


def _model_dir(name: str) -> Path:
    from fineslab.env import FineslabEnv
    from fineslab.models.generate import ensure_model

    return ensure_model(name, FineslabEnv.from_environ().model_cache_dir)


def _server(model: Path, page: int, device: str, log: Path, env: dict[str, str]) -> Any:
    from fineslab.runtime import ServerProcess, ServerSpec, free_port

    # No grammar backend on either device: the CPU rehearsal runs what the GPU runs.
    args: tuple[str, ...] = ("--page-size", str(page), "--log-level", "warning",
                             "--grammar-backend", "none")
    if device == "cuda":
        args += CUDA_ARGS
    spec = ServerSpec(str(model), free_port(), cpu=device == "cpu", extra_args=args, env=env)
    server = ServerProcess(spec, log, warm=False)
    try:
        server.wait_healthy(240)
    except BaseException:
        server.stop()
        raise
    return server


def _greedy(base_url: str) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        body = {"input_ids": list(prompt),
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
        reply = httpx.post(base_url + "/generate", json=body, timeout=300)
        reply.raise_for_status()
        outputs.append([int(t) for t in reply.json()["output_ids"]])
    return outputs


def stage_env(device: str, out: Path) -> dict[str, Any]:
    import importlib.metadata

    import torch

    figures: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        figures["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            figures["gpu"] = torch.cuda.get_device_name(0)
            figures["capability"] = list(torch.cuda.get_device_capability(0))
    for name in ("triton", "sglang", "sgl_kernel", "transformers"):
        try:
            module = __import__(name)
            figures[name] = f"{getattr(module, '__version__', '?')} ({module.__file__})"
        except Exception as exc:  # a report, whatever failed
            figures[name] = f"not importable: {type(exc).__name__}: {exc}"
    plugins = [ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")]
    figures["sglang_plugins"] = plugins
    figures["ok"] = "fineslab.sglang_plugin:register" in plugins and \
        not str(figures["sglang"]).startswith("not importable")
    return figures


def stage_stock(device: str, out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for model, page in (("llama-tiny", 1), ("llama-tiny", 16), ("qwen2-tiny", 16)):
        start_s = time.monotonic()
        server = _server(_model_dir(model), page, device, out / f"stock-{model}-{page}.log", {})
        try:
            ready_s = time.monotonic() - start_s
            results[f"{model}/page{page}"] = {"ready_s": round(ready_s, 1),
                                              "output_ids": _greedy(server.spec.base_url)}
        finally:
            server.stop()
    ok = all(len(o) == NEW_TOKENS for r in results.values() for o in r["output_ids"])
    return {"ok": ok, "runs": results}


def _blocks_per_slab(model: Path, page: int) -> int:
    """Blocks of `model`'s bf16 KV format at `page` in one slab (its layers, KV heads and head
    size from its config.json)."""
    from fineslab.slabs import KVDtype, KVShape
    from fineslab.slabs.sizing import fit_format

    config = json.loads((model / "config.json").read_text())
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    shape = KVShape(model.name, int(config["num_hidden_layers"]),
                    int(config["num_key_value_heads"]), head_dim, KVDtype.from_name("bfloat16"))
    fmt = fit_format(shape, SLAB_BYTES, [page])
    if fmt is None:
        raise RuntimeError(f"no block format of {model.name} fits a {SLAB_BYTES} B slab")
    return fmt.blocks_per_slab(SLAB_BYTES)


def _arena(device: str, blocks_per_slab: int) -> Any:
    from fineslab.slabs import ArenaSpec, SlabArena

    return SlabArena.create(ArenaSpec(f"gl{uuid.uuid4().hex[:8]}",
                                      "cuda:0" if device == "cuda" else "cpu:0",
                                      ARENA_SLABS * SLAB_BYTES, SLAB_BYTES, blocks_per_slab))


def stage_slab_pool(device: str, out: Path) -> dict[str, Any]:
    from fineslab.sglang_plugin import ArenaJoin
    from fineslab.slabs import snapshot

    model = _model_dir("llama-tiny")
    runs: dict[str, Any] = {}
    for page in (1, 16):
        arena = _arena(device, _blocks_per_slab(model, page))
        try:
            stock = _server(model, page, device, out / f"slab-stock-{page}.log", {})
            try:
                expected = _greedy(stock.spec.base_url)
            finally:
                stock.stop()
            env = ArenaJoin(arena.spec.fleet_id, "r").environ()
            server = _server(model, page, device, out / f"slab-pool-{page}.log", env)
            try:
                got = _greedy(server.spec.base_url)
                owners = {o.runtime_id: o.num_slabs for o in snapshot(arena.table).owners
                          if o.alive}
            finally:
                server.stop()
        finally:
            arena.close()
        runs[f"page{page}"] = {"identical": got == expected, "joined": "r" in owners,
                               "slabs": owners.get("r", 0), "output_ids": got,
                               "stock_output_ids": expected}
    ok = all(r["identical"] and r["joined"] for r in runs.values())
    return {"ok": ok, "runs": runs}


def stage_sharing(device: str, out: Path) -> dict[str, Any]:
    """llama-tiny and qwen2-tiny in one arena, both serving; the second SIGKILLed with a request
    in flight; its slabs reclaimed, the table whole, the first serving as before."""
    from fineslab.sglang_plugin import ArenaJoin
    from fineslab.slabs import check_integrity, snapshot

    models = {"a": _model_dir("llama-tiny"), "b": _model_dir("qwen2-tiny")}
    arena = _arena(device, max(_blocks_per_slab(m, 16) for m in models.values()))
    servers: dict[str, Any] = {}
    try:
        for rid, model in models.items():
            servers[rid] = _server(model, 16, device, out / f"sharing-{rid}.log",
                                   ArenaJoin(arena.spec.fleet_id, rid).environ())
        first = {rid: _greedy(server.spec.base_url) for rid, server in servers.items()}
        held = {o.runtime_id: o.num_slabs for o in snapshot(arena.table).owners if o.alive}
        in_flight = threading.Thread(target=_greedy_quietly, args=(servers["b"].spec.base_url,))
        in_flight.start()
        for pid in servers["b"].tree_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while servers["b"].tree_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        in_flight.join(60)
        reclaimed = arena.table.reclaim_dead_owners()
        after = {o.runtime_id for o in snapshot(arena.table).owners if o.alive}
        check_integrity(arena.table)
        again = _greedy(servers["a"].spec.base_url)
    finally:
        for server in servers.values():
            server.stop()
        arena.close()
    ok = (set(held) == {"a", "b"} and "b" not in after and again == first["a"])
    return {"ok": ok, "held_slabs": held, "reclaimed": sorted(reclaimed),
            "alive_after_kill": sorted(after), "a_identical_after": again == first["a"],
            "integrity": "ok"}


def _greedy_quietly(base_url: str) -> None:
    with contextlib.suppress(Exception):  # its runtime is killed under it
        _greedy(base_url)


_HARNESS = stage_weights.Harness(_server, _greedy, _model_dir, _blocks_per_slab, SLAB_BYTES)
STAGES: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "env": stage_env, "stock": stage_stock, "slab-pool": stage_slab_pool,
    "sharing": stage_sharing,
    "weights": functools.partial(stage_weights.stage_weights, _HARNESS),
    "streaming": functools.partial(stage_weights.stage_streaming, _HARNESS),
    "precisions": stage_precisions, "bench": stage_bench}
#: Each stage's bound, seconds (generous: the CPU twin's times; on an H200 far less is expected).
TIMEOUTS_S = {"env": 60.0, "stock": 120.0, "slab-pool": 150.0, "sharing": 120.0,
              "weights": 90.0, "streaming": 75.0, "precisions": 240.0, "bench": 180.0}


def run_stage(name: str, device: str, out: Path, timeout_s: float) -> dict[str, Any]:
    """Run one stage in a child process; its figures, `seconds`, and `error` if it failed."""
    start_s = time.monotonic()
    log = out / f"{name}.log"
    result_path = out / f"{name}.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "fineslab.gpu_lite.check", "--run-stage", name,
               "--device", device, "--out", str(out)]
    with open(log, "wb") as f:
        child = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            code: int | None = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            # the stage's whole group (a server it started stops with its lifeline too)
            stop_group(child.pid, grace_s=5.0, reap=child.poll)
    seconds = round(time.monotonic() - start_s, 1)
    if result_path.exists():
        figures = json.loads(result_path.read_text())
    elif code is None:
        figures = {"ok": False, "error": f"timed out after {timeout_s:g} s"}
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        figures = {"ok": False, "error": f"exited {code}: {' / '.join(tail)}"}
    return {**figures, "seconds": seconds}


def _child(name: str, device: str, out: Path) -> int:
    try:
        figures = STAGES[name](device, out)
    except Exception as exc:  # the stage's failure is its result, in its own words
        import traceback

        traceback.print_exc()
        figures = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    (out / f"{name}.json").write_text(json.dumps(figures, sort_keys=True) + "\n")
    return 0 if figures.get("ok") else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fineslab.gpu_lite.check",
        description="The staged device check: SGLang through fineslab on the lent GPU, each "
                    "stage bounded and logged, a failure never stopping the next.")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or
                                                         REPO / "results" / "gpu-lite"),
                        help="logs and figures (default: $OUT, else results/gpu-lite)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated, of {', '.join(STAGES)} (default: all)")
    parser.add_argument("--stage-timeout-s", type=float, default=None,
                        help="every stage's bound (default: each stage's own, "
                             f"{', '.join(f'{k} {v:g} s' for k, v in TIMEOUTS_S.items())})")
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=S",
                        help="one stage's bound, over the others (repeatable)")
    parser.add_argument("--run-stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        parser.error(f"--stages: unknown {unknown or 'none given'}; known: {', '.join(STAGES)}")
    timeouts = {name: args.stage_timeout_s or TIMEOUTS_S[name] for name in STAGES}
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        try:
            timeouts[name] = float(seconds)
        except ValueError:
            parser.error(f"--timeout {item!r}: give STAGE=SECONDS")
        if name not in STAGES or timeouts[name] <= 0:
            parser.error(f"--timeout {item!r}: a stage of {', '.join(STAGES)} and seconds > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_stage:
        return _child(args.run_stage, args.device, args.out)
    results: dict[str, Any] = {}
    for name in stages:
        print(f"== stage {name} (log: {args.out / (name + '.log')})", flush=True)
        results[name] = run_stage(name, args.device, args.out, timeouts[name])
        verdict = "ok" if results[name].get("ok") else f"FAILED: {results[name].get('error', '')}"
        print(f"   {verdict} in {results[name]['seconds']} s", flush=True)
    print(json.dumps({"device": args.device, "stages": results}, sort_keys=True))
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

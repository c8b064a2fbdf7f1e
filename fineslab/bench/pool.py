"""Decode throughput of one SGLang runtime with the slab pool against SGLang's own pool.

    python -m fineslab.bench.pool [--device auto|cpu|cuda] [--attention-backend triton ...] --json

Both runtimes run side by side as real SGLang servers (same model, page size and arguments; the
plugin one joins an arena this benchmark creates, the stock one gets the same token capacity
through --max-total-tokens). Rounds alternate between them, so drift in the machine's load hits
both alike; each round sends `--requests` concurrent greedy requests of short prompts with
`ignore_eos`, so the time is dominated by decoding. Reported per runtime: the median over rounds
of generated tokens / wall seconds, and `ratio`, the median of the round-by-round ratios
plugin / stock, each with its spread (`*_spread`: median, min, max, n). Target: ratio >= 0.95.

`--device auto` (the default) runs the CPU comparison (keys `plugin_tok_s`, `stock_tok_s`,
`ratio`), then, on a machine with CUDA, the same comparison on the GPU with each attention
backend (keys `gpu_<backend>_plugin_tok_s`, `..._stock_tok_s`, `..._ratio`); `--device cpu` or
`--device cuda` runs only that half (JSON `device`: `cpu`, `cuda` or `cpu+cuda`), and
`--attention-backend` (repeatable) picks the GPU backends (default: all of `GPU_BACKENDS`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from fineslab import cpu_mode
from fineslab.bench.repeats import interleave, ratios, spread
from fineslab.env import FineslabEnv
from fineslab.models.generate import ensure_model
from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin.config import ArenaJoin
from fineslab.slabs import ArenaSpec, KVDtype, KVShape, SlabArena
from fineslab.slabs.sizing import fit_format
from fineslab.tables import add_json_flag, emit

logger = logging.getLogger(__name__)

SLAB_BYTES = 1 << 20
DEVICES = ("auto", "cpu", "cuda")
GPU_BACKENDS = ("triton", "flashinfer")


@dataclass(frozen=True)
class BenchConfig:
    """The load of one comparison."""

    model: str
    page_size: int
    num_requests: int
    prompt_tokens: int
    new_tokens: int
    rounds: int
    capacity_tokens: int

    def __post_init__(self) -> None:
        if min(self.num_requests, self.prompt_tokens, self.new_tokens, self.rounds) <= 0:
            raise ValueError("requests, prompt tokens, new tokens and rounds must be positive")


def _one_round(base_url: str, cfg: BenchConfig, seed: int) -> float:
    """Tokens per second of one round of concurrent requests."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(cfg.prompt_tokens)]
               for _ in range(cfg.num_requests)]
    counts = [0] * len(prompts)

    def send(i: int) -> None:
        resp = httpx.post(base_url + "/generate", timeout=600, json={
            "input_ids": prompts[i], "sampling_params": {
                "temperature": 0, "max_new_tokens": cfg.new_tokens, "ignore_eos": True}})
        resp.raise_for_status()
        counts[i] = len(resp.json()["output_ids"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if sum(counts) != cfg.num_requests * cfg.new_tokens:
        raise RuntimeError(f"round produced {sum(counts)} tokens, expected "
                           f"{cfg.num_requests * cfg.new_tokens}")
    return sum(counts) / elapsed


def _arena_for(cfg: BenchConfig, device: str) -> tuple[SlabArena, ArenaJoin]:
    shape = KVShape("bench", 4, 2, 64, KVDtype.BF16)  # llama-tiny's KV geometry
    fmt = fit_format(shape, SLAB_BYTES, [cfg.page_size])
    if fmt is None:
        raise ValueError(f"page size {cfg.page_size} does not fit a {SLAB_BYTES} B slab")
    # The stock pool's capacity plus its padding page, in slabs, plus slab 0 (the arena keeps
    # it as the padding slab and never hands it out).
    num_slabs = 1 + -(-(cfg.capacity_tokens + cfg.page_size) * fmt.token_stride_bytes
                      // SLAB_BYTES)
    fleet = f"bench{uuid.uuid4().hex[:8]}"
    spec = ArenaSpec(fleet, device, num_slabs * SLAB_BYTES, SLAB_BYTES,
                     fmt.blocks_per_slab(SLAB_BYTES))
    return SlabArena.create(spec), ArenaJoin(fleet, "bench")


def compare(cfg: BenchConfig, model_path: Path, logs: Path, *, cpu: bool,
            backend_args: Sequence[str]) -> dict[str, list[float]]:
    """Each side's tok/s ("plugin", "stock"), one per round, the rounds interleaved."""
    arena, join = _arena_for(cfg, "cpu:0" if cpu else "cuda:0")
    common = ("--dtype", "bfloat16", "--page-size", str(cfg.page_size),
              "--log-level", "warning", *backend_args)
    specs = {
        "plugin": ServerSpec(str(model_path), free_port(), cpu=cpu, extra_args=common,
                             env=join.environ()),
        "stock": ServerSpec(str(model_path), free_port(), cpu=cpu, extra_args=(
            *common, "--max-total-tokens", str(cfg.capacity_tokens))),
    }
    servers: dict[str, ServerProcess] = {}
    try:
        for name, spec in specs.items():
            servers[name] = ServerProcess(spec, logs / f"{name}.log")
        for server in servers.values():
            server.wait_healthy(600)
        for server in servers.values():  # warm-up round, not counted
            _one_round(server.spec.base_url, cfg, seed=0)
        rates = interleave(
            {name: functools.partial(_round_of, servers[name].spec.base_url, cfg)
             for name in ("plugin", "stock")}, cfg.rounds,
            progress=lambda name, r, rate: logger.info("round %d %s: %.1f tok/s", r, name, rate))
    finally:
        # Every server is stopped and the arena closed even if one stop fails or a signal
        # lands in the middle (a stop left out here would leave an orphan runtime spinning).
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(arena.close)
            for server in servers.values():
                cleanup.callback(server.stop)
    return rates


def _round_of(base_url: str, cfg: BenchConfig, r: int) -> float:
    """Round r's tok/s (its prompts seeded by r, the same for both sides)."""
    return _one_round(base_url, cfg, seed=r + 1)


@dataclass(frozen=True)
class Comparison:
    """One plugin-against-stock comparison: on the CPU, or on CUDA with one attention backend."""

    label: str
    cpu: bool
    backend: str | None = None

    @property
    def backend_args(self) -> tuple[str, ...]:
        return () if self.backend is None else ("--attention-backend", self.backend)


def plan_comparisons(device: str, backends: Sequence[str], has_cuda: bool
                     ) -> list[Comparison]:
    """The comparisons `--device` and `--attention-backend` ask for on this machine."""
    runs = [Comparison("cpu torch_native", cpu=True)] if device in ("auto", "cpu") else []
    if device == "cuda" or (device == "auto" and has_cuda):
        runs += [Comparison(f"cuda {b}", cpu=False, backend=b) for b in backends]
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.pool",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--capacity-tokens", type=int, default=8192)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/fineslab-bench-pool"))
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: the CPU, then CUDA if torch sees a GPU")
    parser.add_argument("--attention-backend", dest="backends", action="append",
                        choices=GPU_BACKENDS,
                        help="a CUDA attention backend to compare (repeatable; default: all)")
    add_json_flag(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`build_parser()`'s arguments, with the rule between two of them checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.backends:
        parser.error("--attention-backend picks CUDA backends: not with --device cpu")
    args.backends = args.backends or list(GPU_BACKENDS)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    has_cuda = cpu_mode.cuda_available()
    if args.device == "cuda" and not has_cuda:
        raise SystemExit("fineslab.bench.pool --device cuda: torch sees no CUDA device")
    runs = plan_comparisons(args.device, args.backends, has_cuda)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # A SIGTERM must still stop the servers this benchmark started (the `finally` in compare).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = BenchConfig(args.model, args.page_size, args.requests, args.prompt_tokens,
                      args.new_tokens, args.rounds, args.capacity_tokens)
    args.logs.mkdir(parents=True, exist_ok=True)
    model_path = ensure_model(cfg.model, FineslabEnv.from_environ().model_cache_dir)
    result: dict[str, object] = {"device": "+".join(dict.fromkeys(
        "cpu" if run.cpu else "cuda" for run in runs))}
    rows: list[list[object]] = []
    for run in runs:
        rates = compare(cfg, model_path, args.logs, cpu=run.cpu, backend_args=run.backend_args)
        plugin, stock = spread(rates["plugin"], 1), spread(rates["stock"], 1)
        ratio = spread(ratios(rates["plugin"], rates["stock"]), 3)
        prefix = "" if run.backend is None else f"gpu_{run.backend}_"
        result.update({f"{prefix}plugin_tok_s": plugin["median"],
                       f"{prefix}stock_tok_s": stock["median"], f"{prefix}ratio": ratio["median"],
                       f"{prefix}plugin_tok_s_spread": plugin,
                       f"{prefix}stock_tok_s_spread": stock, f"{prefix}ratio_spread": ratio})
        rows.append([run.label, _with_spread(plugin), _with_spread(stock), _with_spread(ratio)])
    emit(f"Decode throughput, {cfg.model}, {cfg.num_requests} x {cfg.new_tokens} new tokens, "
         f"page {cfg.page_size}, median (min-max) of {cfg.rounds} interleaved rounds; the ratio "
         "round by round", ["runtime", "plugin tok/s", "stock tok/s", "ratio"], rows, result,
         args.json)


def _with_spread(figure: dict[str, float]) -> str:
    return f"{figure['median']:g} ({figure['min']:g}-{figure['max']:g})"


if __name__ == "__main__":
    main()

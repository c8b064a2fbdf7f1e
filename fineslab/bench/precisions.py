"""Benchmark: KV tokens stored per GiB of arena, and decode tokens/s, for each precision.

    python -m fineslab.bench.precisions [--device cpu|cuda] [--model auto|llama-tiny]
                                        [--no-decode] [--batch 4] [--new-tokens 16] [--json]

Capacity comes from the slab plan of one arena holding every named precision of the same
model (SmolLM2-135M if set-up installed it, else the generated llama-tiny) and of an 8B-class
shape (32 layers, 8 KV heads, head_dim 128): tokens_per_gib = GiB * blocks_per_slab * page /
slab. Decode speed: the runtimes (bf16, fp8, awq, kv4, qoq) are started in one arena
(`fineslab.quant.fleet`), then, one runtime at a time, `--batch` greedy requests of
`--new-tokens` tokens each (after one warm-up request); tokens/s = batch * new_tokens / wall
seconds (includes the short prefill).

JSON keys: `tokens_per_gib` {bf16, fp8, awq, kv4, qoq} of the served model, `tokens_per_gib_8b`,
`kv4_vs_bf16`, `fp8_vs_bf16` (ratios; targets >= 3.5 and >= 1.9), `decode_tokens_per_s`
{precision: tokens/s} (absent with --no-decode), `model`, `device`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from fineslab.bench.report import add_json_flag, emit
from fineslab.models import smollm2
from fineslab.models.generate import ensure_model
from fineslab.quant.fleet import (
    PRECISIONS,
    RunningFleet,
    model_kv_shape,
    prepare_runtime,
    run_fleet,
)
from fineslab.slabs import KVShape, plan_slabs
from fineslab.slabs.formats import KVDtype

GIB = 1 << 30
PAGE_SIZE_TOKENS = 16
KV_DTYPES = {"bf16": KVDtype.BF16, "fp8": KVDtype.FP8_E4M3, "awq": KVDtype.FP16,
             "kv4": KVDtype.INT4, "qoq": KVDtype.INT4}
EIGHT_B = KVShape("8b", num_layers=32, num_kv_heads=8, head_dim=128, kv_dtype=KVDtype.BF16)
PROMPT = "The quick brown fox jumps over the lazy dog while the GPU serves four models"


def tokens_per_gib(shape: KVShape) -> dict[str, float]:
    """Tokens per GiB of one arena planned for the four precisions of `shape`."""
    shapes = [dataclasses.replace(shape, name=p, kv_dtype=KV_DTYPES[p]) for p in PRECISIONS]
    plan = plan_slabs(shapes, page_sizes=(PAGE_SIZE_TOKENS,))
    out = {}
    for p in PRECISIONS:
        fmt = plan.format_of(p)
        per_slab = fmt.blocks_per_slab(plan.slab_bytes) * fmt.tokens_per_block
        out[p] = GIB * per_slab / plan.slab_bytes
    return out


def decode_tokens_per_s(fleet: RunningFleet, batch: int, new_tokens: int) -> dict[str, float]:
    speeds = {}
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    for precision, member in fleet.members.items():
        member.generate({"text": PROMPT, "sampling_params": dict(params, max_new_tokens=4)})
        start = time.perf_counter()
        member.generate({"text": [f"{PROMPT} {i}" for i in range(batch)],
                         "sampling_params": params})
        speeds[precision] = batch * new_tokens / (time.perf_counter() - start)
    return speeds


def source_model(cache: Path, name: str) -> Path:
    """SmolLM2-135M when `name` is auto and set-up installed it, else the generated model."""
    found = smollm2.find(Path(os.path.expanduser("~/.cache/fineslab/models")))
    if name == "auto" and found is not None:
        return Path(found)
    return ensure_model("llama-tiny" if name == "auto" else name, cache)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.precisions",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-decode", action="store_true", help="capacity only (no servers)")
    parser.add_argument("--model", default="auto",
                        help="auto (SmolLM2 if installed, else llama-tiny) or a generated preset")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    add_json_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (timeout, CI) unwinds through run_fleet's finally: servers stop, arena closes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.device == "cpu":
        from fineslab import cpu_mode

        cpu_mode.activate()
    with tempfile.TemporaryDirectory(prefix="fineslab-bench-prec-") as tmp:
        work = Path(tmp)
        src = source_model(work, args.model)
        served = tokens_per_gib(model_kv_shape(src, src.name, KVDtype.BF16))
        eight_b = tokens_per_gib(EIGHT_B)
        speeds: dict[str, float] = {}
        if not args.no_decode:
            runtimes = [prepare_runtime(p, src, work, device=args.device) for p in PRECISIONS]
            with run_fleet(runtimes, work, f"bench{os.getpid()}", arena_bytes=64 << 20,
                           page_size_tokens=PAGE_SIZE_TOKENS, cpu=args.device == "cpu") as fleet:
                speeds = decode_tokens_per_s(fleet, args.batch, args.new_tokens)
    result: dict[str, object] = {
        "model": src.name, "device": args.device, "tokens_per_gib": served,
        "tokens_per_gib_8b": eight_b, "kv4_vs_bf16": served["kv4"] / served["bf16"],
        "fp8_vs_bf16": served["fp8"] / served["bf16"]}
    if speeds:
        result["decode_tokens_per_s"] = speeds
    rows = [[p, served[p], eight_b[p], speeds.get(p, float("nan"))] for p in PRECISIONS]
    emit(f"precisions of {src.name} on {args.device}: KV tokens per GiB, decode tokens/s",
         ["precision", "tokens/GiB", "tokens/GiB (8B)", "decode tok/s"], rows, result,
         args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

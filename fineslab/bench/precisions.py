"""Benchmark: KV tokens stored per GiB of arena, and decode tokens/s, for each precision.

    python -m fineslab.bench.precisions [--device cpu|cuda] [--model auto|llama-tiny]
                                        [--no-decode] [--batch 4] [--new-tokens 16] [--json]

Capacity comes from the slab plan of one arena holding every named precision of the same
model (SmolLM2-135M if set-up installed it, else the generated llama-tiny) and of an 8B-class
shape (32 layers, 8 KV heads, head_dim 128): tokens_per_gib = GiB * blocks_per_slab * page /
slab. Decode speed: the runtimes (bf16, fp8, awq, kv4, qoq) are started in one arena
(`fineslab.quant.serving`), then, one runtime at a time, `--batch` greedy requests of
`--new-tokens` tokens each (after one warm-up request); tokens/s = batch * new_tokens / wall
seconds (includes the short prefill), the median of `--repeats` interleaved rounds (3: each
round times every runtime once, the first rotating) with its spread
(`decode_tokens_per_s_spread`).

Weights: each precision's checkpoint as fineslab writes it (bf16 and kv4: the source; fp8:
the FP8 checkpoint, which CPU serves dequantized to bf16; awq group 64; qoq group 128, both with
the largest power-of-two group dividing K where 128 does not): `weight_bytes` is the whole
model (embeddings, norms and lm_head stay 16-bit), `weight_ratio` the linear layers' bytes,
scales and zeros included, against bf16's.

Accuracy (with the fleet): each precision against the bf16 runtime over the precision tests'
prompts (teacher forcing, every position, top-64 prompt logprobs; `fineslab.quant.gates`):
`top1` agreement, `cosine` (mean centered cosine), `kl` (mean KL(bf16 || precision) over
bf16's top 64, nats) and `ppl_ratio` on the tests' text: the figures the tests' gates bound.
On SmolLM2 the same figures are also under `top1_smollm2`, `cosine_smollm2`, ...

JSON keys: `tokens_per_gib` {bf16, fp8, awq, kv4, qoq} of the served model, `tokens_per_gib_8b`,
`kv4_vs_bf16`, `fp8_vs_bf16` (ratios; targets >= 3.5 and >= 1.9), `weight_bytes`,
`weight_ratio` (target qoq <= 0.30), and with the fleet (absent with --no-decode)
`decode_tokens_per_s`, `top1`, `cosine`, `kl`, `ppl_ratio` {precision: value} (and their
`_smollm2` twins); `model`, `device`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fineslab.bench.precision_fleet import RunningFleet, run_fleet
from fineslab.bench.repeats import interleave, spread
from fineslab.models import smollm2
from fineslab.models.generate import ensure_model
from fineslab.precisions import (
    AWQ_GROUP_SIZE,
    FLEET_PRECISIONS,
    NAMED_PRECISIONS,
    QOQ_GROUP_SIZE,
)
from fineslab.quant.awq import AWQConfig, write_awq_checkpoint
from fineslab.quant.checkpoint import LINEAR_SUFFIXES, read_config
from fineslab.quant.fp8 import write_fp8_checkpoint
from fineslab.quant.gates import (
    GATE_PROMPTS,
    GATE_TEXT,
    GATE_TOP_K,
    compare_top_logprobs,
    perplexity,
)
from fineslab.quant.qoq_checkpoint import write_qoq_checkpoint
from fineslab.quant.serving import prepare_runtime
from fineslab.quant.verify import read_headers
from fineslab.slabs import KVShape, plan_slabs
from fineslab.slabs.formats import KVDtype
from fineslab.tables import add_json_flag, emit, repeats_arg

GIB = 1 << 30
PAGE_SIZE_TOKENS = 16
EIGHT_B = KVShape("8b", num_layers=32, num_kv_heads=8, head_dim=128, kv_dtype=KVDtype.BF16)
PROMPT = "The quick brown fox jumps over the lazy dog while the GPU serves four models"

#: Interleaved rounds of the decode timing.
ROUNDS = 3


def tokens_per_gib(shape: KVShape) -> dict[str, float]:
    """Tokens per GiB of one arena planned for the four precisions of `shape`."""
    shapes = [dataclasses.replace(shape, name=p, kv_dtype=NAMED_PRECISIONS[p].kv)
              for p in FLEET_PRECISIONS]
    plan = plan_slabs(shapes, page_sizes=(PAGE_SIZE_TOKENS,))
    out = {}
    for p in FLEET_PRECISIONS:
        fmt = plan.format_of(p)
        per_slab = fmt.blocks_per_slab(plan.slab_bytes) * fmt.tokens_per_block
        out[p] = GIB * per_slab / plan.slab_bytes
    return out


def _is_linear(name: str) -> bool:
    """A tensor of a quantized projection (its weight, or its scales, zeros, packed codes)."""
    return name.rpartition(".")[0].split(".", 3)[-1] in LINEAR_SUFFIXES


def weight_bytes(src: Path, work: Path) -> tuple[dict[str, int], dict[str, float]]:
    """Each precision's checkpoint bytes (whole model) and its linear layers' bytes against
    bf16's (the source's projections at 2 bytes a parameter)."""
    checkpoints = {
        "fp8": write_fp8_checkpoint(src, work / "w-fp8"),
        "awq": write_awq_checkpoint(src, work / "w-awq", AWQConfig(group_size=AWQ_GROUP_SIZE)),
        "qoq": write_qoq_checkpoint(src, work / "w-qoq", group_size=QOQ_GROUP_SIZE)}
    source = read_headers(src)
    bf16_total = sum(2 * i.num_elements for i in source.values())
    bf16_linear = sum(2 * i.num_elements for n, i in source.items() if _is_linear(n))
    total, ratio = {}, {}
    for p in FLEET_PRECISIONS:
        weights = NAMED_PRECISIONS[p].weights.name
        if weights not in checkpoints:
            total[p], ratio[p] = bf16_total, 1.0
            continue
        infos = read_headers(checkpoints[weights])
        total[p] = sum(i.nbytes for i in infos.values())
        ratio[p] = sum(i.nbytes for n, i in infos.items() if _is_linear(n)) / bf16_linear
    return total, ratio


def accuracy(fleet: RunningFleet) -> dict[str, dict[str, float]]:
    """Against the bf16 runtime, per precision: top-1 agreement, mean centered cosine and mean
    truncated KL over the gate prompts, and the perplexity ratio on the gate text (the
    precision tests' gates, `tests/precisions/test_precision_fleet.py`)."""
    payload = {"text": [*GATE_PROMPTS, GATE_TEXT], "return_logprob": True,
               "logprob_start_len": 0, "top_logprobs_num": GATE_TOP_K,
               "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    reference = fleet.members["bf16"].generate(payload)
    out: dict[str, dict[str, float]] = {"top1": {}, "cosine": {}, "kl": {}, "ppl_ratio": {}}
    for precision, member in fleet.members.items():
        got = member.generate(payload)
        gate = compare_top_logprobs(reference[:-1], got[:-1])
        out["top1"][precision], out["cosine"][precision] = gate.top1_agreement, gate.cosine_mean
        out["kl"][precision] = gate.kl_mean
        out["ppl_ratio"][precision] = perplexity(got[-1]) / perplexity(reference[-1])
    return out


def decode_tokens_per_s(fleet: RunningFleet, batch: int, new_tokens: int, rounds: int = ROUNDS,
                        ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Each precision's decode tokens/s, the median of `rounds` interleaved rounds (one batch
    of each runtime a round, the first rotating), and its spread."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def timed(member: Any) -> Callable[[int], float]:
        def one(_round: int) -> float:
            start = time.perf_counter()
            member.generate({"text": [f"{PROMPT} {i}" for i in range(batch)],
                             "sampling_params": params})
            return batch * new_tokens / (time.perf_counter() - start)
        return one

    for member in fleet.members.values():  # one warm-up request each
        member.generate({"text": PROMPT, "sampling_params": dict(params, max_new_tokens=4)})
    speeds = interleave({p: timed(m) for p, m in fleet.members.items()}, rounds)
    return ({p: round(statistics.median(v), 2) for p, v in speeds.items()},
            {p: spread(v) for p, v in speeds.items()})


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
    parser.add_argument("--repeats", type=repeats_arg, default=ROUNDS,
                        help=f"interleaved rounds of the decode timing (default {ROUNDS})")
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
        served = tokens_per_gib(KVShape.from_hf_config(read_config(src), src.name,
                                                       KVDtype.BF16))
        eight_b = tokens_per_gib(EIGHT_B)
        total_bytes, ratio = weight_bytes(src, work)
        speeds: dict[str, float] = {}
        speed_spread: dict[str, dict[str, float]] = {}
        gates: dict[str, dict[str, float]] = {}
        if not args.no_decode:
            runtimes = [prepare_runtime(p, src, work, device=args.device) for p in FLEET_PRECISIONS]
            with run_fleet(runtimes, work, f"bench{os.getpid()}", arena_bytes=64 << 20,
                           page_size_tokens=PAGE_SIZE_TOKENS, cpu=args.device == "cpu") as fleet:
                speeds, speed_spread = decode_tokens_per_s(fleet, args.batch, args.new_tokens,
                                                           args.repeats)
                gates = accuracy(fleet)
    result: dict[str, object] = {
        "model": src.name, "device": args.device, "tokens_per_gib": served,
        "tokens_per_gib_8b": eight_b, "kv4_vs_bf16": served["kv4"] / served["bf16"],
        "fp8_vs_bf16": served["fp8"] / served["bf16"], "weight_bytes": total_bytes,
        "weight_ratio": ratio}
    if speeds:
        result.update(decode_tokens_per_s=speeds, decode_tokens_per_s_spread=speed_spread,
                      **gates)
        if src.name == smollm2.MODEL_NAME:
            result.update({f"{key}_smollm2": value for key, value in gates.items()})
    nan = float("nan")
    top1, kl = gates.get("top1", {}), gates.get("kl", {})
    rows = [[p, served[p], eight_b[p], total_bytes[p], ratio[p], speeds.get(p, nan),
             top1.get(p, nan), kl.get(p, nan)] for p in FLEET_PRECISIONS]
    emit(f"precisions of {src.name} on {args.device}: KV tokens per GiB, weights, decode "
         "tokens/s, accuracy against bf16",
         ["precision", "tokens/GiB", "tokens/GiB (8B)", "weight B", "linear/bf16",
          "decode tok/s", "top-1", "KL"], rows, result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

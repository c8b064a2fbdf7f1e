"""Layer streaming of one model on this machine: Select-N intervals against S empty (issue #17).

`python -m fineslab.bench.streaming --json [--size bench|tiny] [--tokens N]`

One runtime of a generated Llama (default `bench`: 12 layers of about 22 MB of bf16 weights
each; `tiny` is llama-tiny, 4 layers, the short CI version) keeps its weights in a CPU arena
this benchmark creates, each layer on slabs of its own. For S empty and each Select-N interval
i of 2, 4 and 8 (`offload_layers`: the last layer of every i; an interval wider than the model
is skipped), the stream request is written, and once applied:

    kv_gain_bytes      free slabs of the arena after the change less before, in bytes
    lent_bytes         what the runtime reports lent, less its slot buffer (one slot)
    decode_tok_s       (tokens - 1) / (time of a `tokens`-token greedy generation - time of a
                       1-token one), batch 1, the median of 3 rounds (`decode_tok_s_spread`:
                       median, min, max, n)
    streamed_bytes_per_step   layer bytes copied in per forward pass during those generations
    identical          the greedy tokens equal S empty's

At the top level: `identical_all`, `kv_gain_equals_lent` (every interval), `copy_gib_s` (all
streamed bytes / the runtime's time copying them), `memcpy_gib_s` (a layer-sized copy between
resident buffers in this process, best of 3: the limit) and `copy_over_memcpy`.
Targets: identical_all and kv_gain_equals_lent true, copy_over_memcpy >= 0.5.
`--corrupt-host-copy` flips bytes all over the host copy (in place: the runtime's mapping sees
them) after S empty is measured: streamed layers are then read wrong, the negative control of
`identical` (it must come out false for every interval).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from fineslab.bench.repeats import spread
from fineslab.bench.wake import SIZES, memcpy_gib_s
from fineslab.env import FineslabEnv
from fineslab.models.generate import ensure_model
from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.scheduler.selectn import offload_layers
from fineslab.sglang_plugin.config import ArenaJoin
from fineslab.slabs import ArenaSpec, SlabArena, snapshot
from fineslab.slabs.streamctl import (
    apply_request,
    host_copy_path,
    read_state,
    request_path,
    state_path,
)
from fineslab.tables import add_json_flag, emit

SLAB_BYTES = 2 << 20
KV_SLABS = 24
INTERVALS = (2, 4, 8)
PROMPT = list(range(10, 42))
#: Rounds of decode timing per setting (the median is reported, with its spread).
REPEATS = 3


def _generate_s(url: str, tokens: int) -> tuple[float, list[int]]:
    start_s = time.perf_counter()
    reply = httpx.post(url + "/generate", timeout=600, json={
        "input_ids": PROMPT, "sampling_params": {
            "temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}})
    reply.raise_for_status()
    return time.perf_counter() - start_s, list(reply.json()["output_ids"])


def _measure(url: str, fleet_id: str, tokens: int) -> dict[str, Any]:
    """Decode speed, the tokens, and the bytes streamed per pass over the timed generations."""
    before = read_state(fleet_id, "m")
    rates: list[float] = []
    out: list[int] = []
    for _ in range(REPEATS):  # the 1-token and the long generation back to back, each round
        one_s, _ = _generate_s(url, 1)
        many_s, out = _generate_s(url, tokens)
        rates.append((tokens - 1) / max(many_s - one_s, 1e-9))
    after = read_state(fleet_id, "m")
    assert before is not None and after is not None
    passes = max(1, after.passes - before.passes)
    decode = spread(rates, 1)
    return {"decode_tok_s": decode["median"], "decode_tok_s_spread": decode,
            "streamed_bytes_per_step": (after.streamed_bytes - before.streamed_bytes) / passes,
            "tokens": out}


def _corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        for offset in range(0, size, 4096):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x5A]))


def run(size: str, tokens: int, logs: Path, corrupt: bool = False) -> dict[str, Any]:
    preset, overrides = SIZES[size]
    model = ensure_model(preset, FineslabEnv.from_environ().model_cache_dir, **overrides)
    num_layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    weights_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    num_slabs = -(-weights_bytes // SLAB_BYTES) + num_layers + KV_SLABS  # + per-layer padding
    spec = ArenaSpec(f"strm{uuid.uuid4().hex[:8]}", "cpu:0", num_slabs * SLAB_BYTES,
                     SLAB_BYTES, 4096)
    result: dict[str, Any] = {"model": model.name, "num_layers": num_layers, "intervals": {}}
    with SlabArena.create(spec) as arena:
        join = ArenaJoin(spec.fleet_id, "m", weights_in_arena=True, layer_streaming=True)
        server = ServerProcess(ServerSpec(str(model), free_port(), extra_args=(
            "--dtype", "bfloat16", "--page-size", "16", "--log-level", "info"),
            env=join.environ()), logs / "m.log")
        try:
            server.wait_healthy(600)
            url = server.spec.base_url
            apply_request(spec.fleet_id, "m", [])
            free_before = snapshot(arena.table).free_slabs
            base = _measure(url, spec.fleet_id, tokens)
            result["intervals"]["none"] = {k: v for k, v in base.items() if k != "tokens"} | {
                "kv_gain_bytes": 0, "lent_bytes": 0, "identical": True}
            if corrupt:
                _corrupt(host_copy_path(spec.fleet_id, "m"))
            copy_s0 = read_state(spec.fleet_id, "m").copy_seconds  # type: ignore[union-attr]
            streamed0 = read_state(spec.fleet_id, "m").streamed_bytes  # type: ignore[union-attr]
            for interval in (i for i in INTERVALS if i <= num_layers):
                state = apply_request(spec.fleet_id, "m", offload_layers(num_layers, interval))
                gain = (snapshot(arena.table).free_slabs - free_before) * SLAB_BYTES
                got = _measure(url, spec.fleet_id, tokens)
                result["intervals"][str(interval)] = {
                    "layers": state.layers, "kv_gain_bytes": gain,
                    "lent_bytes": state.net_lent_bytes,
                    "decode_tok_s": got["decode_tok_s"],
                    "decode_tok_s_spread": got["decode_tok_s_spread"],
                    "streamed_bytes_per_step": got["streamed_bytes_per_step"],
                    "identical": got["tokens"] == base["tokens"]}
            apply_request(spec.fleet_id, "m", [])
            final = read_state(spec.fleet_id, "m")
            assert final is not None
            span_bytes = weights_bytes // num_layers
        finally:
            server.stop()
            for path in (host_copy_path(spec.fleet_id, "m"), request_path(spec.fleet_id, "m"),
                         state_path(spec.fleet_id, "m")):
                path.unlink(missing_ok=True)
    rows = result["intervals"].values()
    streamed = final.streamed_bytes - streamed0
    copy_s = final.copy_seconds - copy_s0
    result["identical_all"] = all(r["identical"] for r in rows)
    result["kv_gain_equals_lent"] = all(r["kv_gain_bytes"] == r["lent_bytes"] for r in rows)
    result["copy_gib_s"] = streamed / 2**30 / copy_s if copy_s > 0 else 0.0
    result["memcpy_gib_s"] = memcpy_gib_s(span_bytes)
    result["copy_over_memcpy"] = result["copy_gib_s"] / result["memcpy_gib_s"]
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.streaming",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per timed generation")
    parser.add_argument("--corrupt-host-copy", action="store_true",
                        help="negative control: identical must come out false per interval")
    parser.add_argument("--logs", type=Path,
                        default=Path(tempfile.gettempdir()) / "fineslab-bench-streaming")
    add_json_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tokens < 2:
        raise SystemExit("--tokens must be >= 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop servers
    args.logs.mkdir(parents=True, exist_ok=True)
    result = run(args.size, args.tokens, args.logs, args.corrupt_host_copy)
    rows = [[name, r.get("layers", []), r["decode_tok_s"], r["streamed_bytes_per_step"],
             r["kv_gain_bytes"], r["lent_bytes"], r["identical"]]
            for name, r in result["intervals"].items()]
    emit(f"Layer streaming, {result['model']} ({result['num_layers']} layers), CPU arena: "
         f"copy {result['copy_gib_s']:.2f} GiB/s = {result['copy_over_memcpy']:.2f} of memcpy",
         ["interval", "layers", "decode tok/s", "streamed B/step", "kv gain B", "lent B",
          "identical"], rows, result, args.json)


if __name__ == "__main__":
    main()

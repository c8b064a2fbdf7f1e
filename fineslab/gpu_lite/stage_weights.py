"""The staged check's `weights` and `streaming` stages (issue #36 (d) and (e)): weights in the
arena, asleep and awake through SGLang's own endpoints, and layer streaming, on the device.

    weights    llama-tiny with its weights in a region of the arena (`FINESLAB_WEIGHTS_IN_ARENA`):
               on CUDA built there by SGLang's own loader (the plugin's memory saver runs the
               load inside `region_pool`, sglang_plugin/cuda_weights.py), its host copy pinned
               at the first sleep; on CPU moved in after loading. Greedy output identical to the
               stock pool's; then CYCLES sleeps (`/pause_generation` retract,
               `/release_memory_occupation` weights and kv_cache: the table shows 0 weight
               slabs) and wakes (`/resume_memory_occupation`, `/continue_generation`), greedy
               output identical after each. `wake_gib_s` (the region's bytes over the client's
               wake time, as bench.wake) against `link_gib_s`: a pinned host-to-device copy of
               the same size on CUDA, memcpy on CPU (the best of COPY_TRIES, as bench.wake).
               For llama-tiny's 8 MiB the client's wake is mostly SGLang's control path (two
               calls, milliseconds each): the ratio shows the wake works, not the copy's speed
    streaming  llama-tiny with each layer on slabs of its own (`FINESLAB_LAYER_STREAMING`), asked
               to stream layers STREAMED through one slot: StreamCopies on the copy stream on
               CUDA, SyncCopies on CPU (the plugin picks by the weights' device). Greedy output
               identical to the same runtime's with nothing streamed, and again after the layers
               come back; the arena's free slabs grew by the bytes lent. `overlap` =
               (t_none + t_copy - t_stream) / min(t_none, t_copy), as bench.layer_copy, over
               ROUNDS rounds of the prompts each way, interleaved: t_none and t_stream the
               rounds' median wall time without and with streaming, t_copy the round's
               streamed bytes (the runtime's state) at `copy_gib_s`, a layer-sized copy from
               the host copy's kind of memory (pinned on CUDA) measured in this process; on
               CPU None (the copies are synchronous, as bench.layer_copy), the times reported.
               The rounds include HTTP and scheduling: a figure, not a verdict

Each stage gets the check's own harness (`Harness`: its server start with the gpu-lite CUDA
arguments, its greedy requests, models and block formats), so both run exactly as the others.
"""

from __future__ import annotations

import functools
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fineslab.slabs.streamctl import POLL_S

#: Weights (a CUDA load's region is the checkpoint and 22 MiB of torch's segment slack), slab 0
#: and KV for three short prompts.
ARENA_SLABS = 48
CYCLES = 2
ROUNDS = 3
STREAMED = (1, 3)
RUNTIME = "r"
MODEL = "llama-tiny"
PAGE = 16
#: Copies timed for a bandwidth (the best counts: a busy moment must not lower the bar).
COPY_TRIES = 10


@dataclass(frozen=True)
class Harness:
    """What the stages use of the check (fineslab/gpu_lite/check.py)."""

    #: (model dir, page size, device, log, environment) -> a healthy server (`.spec.base_url`,
    #: `.stop()`), with the gpu-lite arguments on CUDA.
    server: Callable[[Path, int, str, Path, dict[str, str]], Any]
    #: base URL -> greedy output ids of the check's prompts.
    greedy: Callable[[str], list[list[int]]]
    model_dir: Callable[[str], Path]
    #: (model dir, page size) -> blocks of its bf16 KV in one slab of `slab_bytes`.
    blocks_per_slab: Callable[[Path, int], int]
    #: The check's slab size (2 MiB: the CUDA mapping granularity, the least a weight region
    #: maps slab by slab).
    slab_bytes: int


def _arena(harness: Harness, device: str, model: Path) -> Any:
    from fineslab.slabs import ArenaSpec, SlabArena

    slab_bytes = harness.slab_bytes
    return SlabArena.create(ArenaSpec(f"gw{uuid.uuid4().hex[:8]}",
                                      "cuda:0" if device == "cuda" else "cpu:0",
                                      ARENA_SLABS * slab_bytes, slab_bytes,
                                      harness.blocks_per_slab(model, PAGE)))


def _slabs_of(arena: Any) -> dict[str, int]:
    from fineslab.slabs import snapshot

    return {o.runtime_id: o.num_slabs for o in snapshot(arena.table).owners if o.alive}


def _free_slabs(arena: Any) -> int:
    from fineslab.slabs.weights import free_weight_slabs

    return free_weight_slabs(arena.table)


def copy_gib_s(device: str, nbytes: int) -> float:
    """The best of COPY_TRIES copies of `nbytes`: pinned host memory to the device on CUDA
    (what a wake from a pinned host copy and a streamed layer's copy use), memcpy on CPU."""
    import torch

    cuda = device == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    best = float("inf")
    for _ in range(COPY_TRIES):
        start_s = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start_s)
    return nbytes / best / 2**30


def _cleanup(arena_name: str) -> None:
    from fineslab.slabs.streamctl import host_copy_path, request_path, state_path

    for path in (host_copy_path(arena_name, RUNTIME), request_path(arena_name, RUNTIME),
                 state_path(arena_name, RUNTIME)):
        path.unlink(missing_ok=True)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def terminable(stage: Callable[[Harness, str, Path], dict[str, Any]]
               ) -> Callable[[Harness, str, Path], dict[str, Any]]:
    """A stage past its bound gets SIGTERM (check.run_stage stops its process group, SIGKILL 5 s
    later): raise SystemExit then, so that its `finally` blocks close (and unlink) its arena and
    remove its files; Python's default would leave /dev/shm/fineslab-gw* behind."""
    @functools.wraps(stage)
    def run(harness: Harness, device: str, out: Path) -> dict[str, Any]:
        previous = signal.signal(signal.SIGTERM, _exit_on_term)
        try:
            return stage(harness, device, out)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return run


@terminable
def stage_weights(harness: Harness, device: str, out: Path) -> dict[str, Any]:
    from fineslab.bench.wake import TAGS, timed_post
    from fineslab.sglang_plugin import ArenaJoin

    post = functools.partial(timed_post, timeout_s=300.0)

    model = harness.model_dir(MODEL)
    stock = harness.server(model, PAGE, device, out / "weights-stock.log", {})
    try:
        expected = harness.greedy(stock.spec.base_url)
    finally:
        stock.stop()
    arena = _arena(harness, device, model)
    cycles: list[dict[str, Any]] = []
    try:
        env = ArenaJoin(arena.spec.fleet_id, RUNTIME, weights_in_arena=True).environ()
        server = harness.server(model, PAGE, device, out / "weights-arena.log", env)
        try:
            url = server.spec.base_url
            first = harness.greedy(url)
            weight_slabs = _slabs_of(arena).get(RUNTIME + ":w", 0)
            with httpx.Client(base_url=url) as client:
                for _ in range(CYCLES):
                    sleep_s = (post(client, "/pause_generation", {"mode": "retract"})
                               + post(client, "/release_memory_occupation", TAGS))
                    asleep = _slabs_of(arena)
                    wake_s = (post(client, "/resume_memory_occupation", TAGS)
                              + post(client, "/continue_generation", {}))
                    awake = _slabs_of(arena)
                    cycles.append({
                        "sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
                        "asleep_weight_slabs": asleep.get(RUNTIME + ":w", 0),
                        "awake_weight_slabs": awake.get(RUNTIME + ":w", 0),
                        "identical": harness.greedy(url) == first})
        finally:
            server.stop()
    finally:
        arena.close()
        _cleanup(arena.spec.fleet_id)
    region_bytes = weight_slabs * harness.slab_bytes
    wake_s = statistics.median(c["wake_s"] for c in cycles)
    link = copy_gib_s(device, region_bytes)
    wake_gib_s = region_bytes / wake_s / 2**30
    ok = (first == expected and weight_slabs > 0 and len(cycles) == CYCLES
          and all(c["identical"] and c["asleep_weight_slabs"] == 0
                  and c["awake_weight_slabs"] == weight_slabs for c in cycles))
    return {"ok": ok, "identical_to_stock": first == expected, "weight_slabs": weight_slabs,
            "region_bytes": region_bytes, "cycles": cycles, "wake_s": round(wake_s, 4),
            "wake_gib_s": round(wake_gib_s, 3), "link_gib_s": round(link, 3),
            "link": "pinned host to device" if device == "cuda" else "memcpy",
            "wake_over_link": round(wake_gib_s / link, 3), "output_ids": first,
            "stock_output_ids": expected}


def _ask(arena_name: str, layers: tuple[int, ...]) -> Any:
    """Ask the runtime to stream `layers` through one slot and wait until it applied it."""
    from fineslab.slabs.streamctl import apply_request

    return apply_request(arena_name, RUNTIME, layers, 1)


def _state(arena_name: str) -> Any:
    from fineslab.slabs.streamctl import read_state

    state = read_state(arena_name, RUNTIME)
    if state is None:
        raise RuntimeError(f"the runtime wrote no stream state for arena {arena_name}")
    return state


def _timed_greedy(harness: Harness, url: str, outputs: list[list[list[int]]]) -> float:
    """One round of the check's prompts; its output appended to `outputs`; its seconds."""
    start_s = time.perf_counter()
    outputs.append(harness.greedy(url))
    return time.perf_counter() - start_s


@terminable
def stage_streaming(harness: Harness, device: str, out: Path) -> dict[str, Any]:
    from fineslab.sglang_plugin import ArenaJoin

    model = harness.model_dir(MODEL)
    arena = _arena(harness, device, model)
    name = arena.spec.fleet_id
    try:
        env = ArenaJoin(name, RUNTIME, weights_in_arena=True, layer_streaming=True).environ()
        server = harness.server(model, PAGE, device, out / "streaming.log", env)
        try:
            url = server.spec.base_url
            expected = harness.greedy(url)  # (warms the runtime too)
            free_resident = _free_slabs(arena)
            lent = _ask(name, STREAMED)
            free_streaming = _free_slabs(arena)
            outputs = [harness.greedy(url)]
            time.sleep(2 * POLL_S)  # the runtime publishes its counters within POLL_S
            before = _state(name)
            t_none, t_stream = [], []
            for _ in range(ROUNDS):  # interleaved: a busy machine's drift falls on both
                _ask(name, ())
                t_none.append(_timed_greedy(harness, url, outputs))
                _ask(name, STREAMED)
                t_stream.append(_timed_greedy(harness, url, outputs))
            time.sleep(2 * POLL_S)
            after = _state(name)
            back = _ask(name, ())
            free_back = _free_slabs(arena)
            outputs.append(harness.greedy(url))
        finally:
            server.stop()
    finally:
        arena.close()
        _cleanup(name)
    round_bytes = (after.streamed_bytes - before.streamed_bytes) / ROUNDS
    rate = copy_gib_s(device, lent.layer_bytes)
    t_copy = round_bytes / rate / 2**30
    none_s, stream_s = statistics.median(t_none), statistics.median(t_stream)
    # On CPU the copies are synchronous: no overlap to measure (as bench.layer_copy).
    overlap = ((none_s + t_copy - stream_s) / min(none_s, t_copy)
               if device == "cuda" and t_copy > 0 else None)
    identical = all(o == expected for o in outputs)
    gained = (free_streaming - free_resident) * harness.slab_bytes
    ok = (identical and tuple(lent.layers) == STREAMED and round_bytes > 0
          and gained == lent.lent_bytes - lent.slot_bytes > 0
          and free_back == free_resident and not back.layers)
    return {"ok": ok, "identical": identical, "streamed_layers": list(lent.layers),
            "copies": "StreamCopies" if device == "cuda" else "SyncCopies",
            "lent_bytes": lent.lent_bytes, "slot_bytes": lent.slot_bytes,
            "arena_gain_bytes": gained, "returned_all": free_back == free_resident,
            "streamed_bytes_per_round": int(round_bytes), "layer_bytes": lent.layer_bytes,
            "copy_gib_s": round(rate, 3), "t_none_s": round(none_s, 4),
            "t_stream_s": round(stream_s, 4), "t_copy_s": round(t_copy, 5),
            "overlap": None if overlap is None else round(overlap, 3),
            "t_none_s_all": [round(t, 4) for t in t_none],
            "t_stream_s_all": [round(t, 4) for t in t_stream], "output_ids": outputs[-1]}

"""Helpers shared by the SGLang plugin tests: arenas, engines, servers, prompts, table readings."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import torch

from fineslab.runtime import (
    ServerProcess,
    ServerSpec,
    free_port,
    start_server,
)
from fineslab.sglang_plugin import ArenaJoin
from fineslab.slabs import (
    ArenaSpec,
    KVDtype,
    KVShape,
    RuntimeSlabs,
    SlabArena,
    check_integrity,
    snapshot,
)
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.sizing import fit_format
from fineslab.slabs.views import layer_views

if TYPE_CHECKING:
    from fineslab.sglang_plugin.allocator import SlabAllocator
    from fineslab.slabs.table import SlabTable

#: stock_outputs(model, page_size, dtype, prompts, max_new_tokens) -> outputs (conftest.py).
Reference = Callable[[str, int, str, tuple[tuple[int, ...], ...], int], list[list[int]]]

#: (num_layers, num_kv_heads, head_dim) of the generated presets.
GEOMETRY = {"llama-tiny": (4, 2, 64), "qwen2-tiny": (3, 2, 64)}


def prompts(num: int, length: int, seed: int, vocab: int = 2000) -> list[list[int]]:
    """`num` random prompts of `length` token ids (ids 10.. to stay clear of special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(num)]


def kv_shape(model: str, dtype: str, name: str | None = None) -> KVShape:
    layers, heads, head_dim = GEOMETRY[model]
    return KVShape(name or model, layers, heads, head_dim, KVDtype.from_name(dtype))


@dataclass
class ScratchArena:
    """An arena created by the test process (the launcher's role), closed at teardown."""

    arena: SlabArena
    fleet_id: str

    @classmethod
    def create(cls, slab_bytes: int, num_slabs: int, max_blocks_per_slab: int) -> ScratchArena:
        fleet_id = f"t{uuid.uuid4().hex[:10]}"
        spec = ArenaSpec(fleet_id, "cpu:0", slab_bytes * num_slabs, slab_bytes,
                         max_blocks_per_slab)
        return cls(SlabArena.create(spec), fleet_id)

    def join(self, runtime_id: str) -> ArenaJoin:
        return ArenaJoin(self.fleet_id, runtime_id)

    @property
    def arena_bytes(self) -> int:
        return self.arena.spec.arena_bytes

    def used_bytes(self) -> dict[str, int]:
        """Bytes of blocks in use per live runtime id, from the shared slab table."""
        return {o.runtime_id: o.used_bytes for o in snapshot(self.arena.table).owners if o.alive}

    def close(self) -> None:
        self.arena.close()


def arena_for(models: Sequence[KVShape], page_size: int, slab_bytes: int,
              num_slabs: int) -> ScratchArena:
    """An arena whose slab size fits every model at `page_size`."""
    bps = []
    for shape in models:
        fmt = fit_format(shape, slab_bytes, [page_size])
        assert fmt is not None, f"{shape.name} must fit a {slab_bytes} B slab"
        bps.append(fmt.blocks_per_slab(slab_bytes))
    return ScratchArena.create(slab_bytes, num_slabs, max(bps))


def settled_integrity(table: SlabTable, quiet_s: float = 0.3, timeout_s: float = 20.0) -> None:
    """`check_integrity(table)` once the runtimes stop changing it.

    A runtime takes and gives back blocks in its own slabs without the table lock, so the
    per-slab counts (T3/T4) are exact only while it is quiescent; a request's answer can
    reach the client before the scheduler's last frees (SGLang's overlap schedule frees a
    finished request's look-ahead token one step later). Waits until the counts have not moved
    for `quiet_s`, then checks; a table that never settles fails with its last error.
    """
    deadline = time.monotonic() + timeout_s
    last, quiet_since = None, time.monotonic()
    while True:
        counts = (table.used.copy(), table.free_map.copy(), table.state.copy())
        if last is None or any(not np.array_equal(a, b) for a, b in zip(counts, last,
                                                                         strict=True)):
            last, quiet_since = counts, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            check_integrity(table)
            return
        if time.monotonic() > deadline:
            check_integrity(table)  # raises what is wrong; passes if the table is sound
            return
        time.sleep(0.02)


def slab_allocator(arena: ScratchArena, source: RuntimeSlabs, fmt: BlockFormat, page: int,
                   size: int, page_bytes: torch.Tensor | None = None) -> SlabAllocator:
    """A SlabAllocator over `source` with a SlabKVPool over `arena` (BF16, on CPU)."""
    from fineslab.sglang_plugin.allocator import SlabAllocator
    from fineslab.sglang_plugin.pool import SlabKVPool

    pool = SlabKVPool.over(layer_views(arena.arena.tensor(), fmt))(  # type: ignore[arg-type]
        size, page_size=page, dtype=torch.bfloat16, head_num=fmt.shape.num_kv_heads,
        head_dim=fmt.shape.head_dim, layer_num=fmt.shape.num_layers, device="cpu",
        enable_memory_saver=False)
    return SlabAllocator(size, page, torch.bfloat16, "cpu", pool, False, source=source,
                         page_bytes=page_bytes)


@contextlib.contextmanager
def joined(join: ArenaJoin | None) -> Iterator[None]:
    """The join variables in os.environ while an Engine spawns its scheduler."""
    saved = {k: os.environ.get(k) for k in ArenaJoin("a", "b", True, True).environ()}
    if join is not None:
        os.environ.update(join.environ())
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def whole_page_chunk(page_size: int) -> dict[str, object]:
    """Engine kwargs for a page SGLang's default prefill chunk (a power of two) is not whole
    pages of: SGLang asks that the chunk be whole pages."""
    return {"chunked_prefill_size": 200 * page_size} if page_size & (page_size - 1) else {}


def _server_args(page_size: int, dtype: str) -> list[str]:
    """What a plugin or stock server of these tests is told (CPU flags come from ServerSpec)."""
    chunk = whole_page_chunk(page_size).get("chunked_prefill_size")
    return ["--dtype", dtype, "--page-size", str(page_size), "--log-level", "error",
            *(["--chunked-prefill-size", str(chunk)] if chunk else [])]


def plugin_outputs(model_path: Path, input_ids: list[list[int]], *, page_size: int,
                   join: ArenaJoin, dtype: str = "bfloat16", max_new_tokens: int = 16,
                   ) -> list[list[int]]:
    """Greedy outputs of a server with the plugin's pool over the arena `join` names (forked
    warm from the zygote, told the join in its environment, as a launched fleet's runtime is),
    stopped before this returns."""
    spec = ServerSpec(str(model_path), free_port(),
                      extra_args=tuple(_server_args(page_size, dtype)), env=join.environ())
    with start_server(spec) as server:
        return server_batches(model_path, [(input_ids, max_new_tokens)], page_size=page_size,
                              dtype=dtype, server=server)[0]


def stock_server(model_path: Path, page_size: int, dtype: str = "bfloat16") -> ServerProcess:
    """A server of SGLang's own pool for `server_batches`, forked warm from the zygote: the
    same scheduler and arguments behind /generate as an in-process engine (outputs identical,
    checked 2026-11-29 for llama-tiny at pages 16 and 3 and qwen2-tiny at page 1), where an
    engine costs 15-50 s to start and, after it, a new zygote (the variables it sets in this
    process). It sleeps when idle (`--sleep-on-idle`: no CPU between the tests it serves)."""
    extra = (*_server_args(page_size, dtype), "--max-total-tokens", "4096", "--sleep-on-idle")
    return start_server(ServerSpec(str(model_path), free_port(), extra_args=extra))


def server_batches(model_path: Path, jobs: list[tuple[list[list[int]], int]], *, page_size: int,
                   dtype: str = "bfloat16", server: ServerProcess | None = None,
                   ) -> list[list[list[int]]]:
    """Greedy outputs of each (prompts, new tokens) batch on `server` (a `stock_server` of the
    same settings, or a plugin server: `plugin_outputs`) or on a stock server started for these
    jobs alone. The prefix cache is flushed before each batch: a kept server answers as a fresh
    one. The stock reference outputs are computed here (`StockOutputs`)."""
    own = server is None
    if server is None:
        server = stock_server(model_path, page_size, dtype)
    outputs = []
    try:
        for input_ids, max_new_tokens in jobs:
            httpx.post(server.spec.base_url + "/flush_cache", timeout=60).raise_for_status()
            resp = httpx.post(server.spec.base_url + "/generate", timeout=1200, json={
                "input_ids": input_ids, "sampling_params": {
                    "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
            resp.raise_for_status()
            outputs.append([list(o["output_ids"]) for o in resp.json()])
    finally:
        if own:
            server.stop()
    return outputs


class StockServers:
    """The last `keep` stock servers, one per (model, page size, dtype), kept between the
    session's reference computations (a cold cache asks several batches of each settings, at
    different tests: a start each, before). `start` makes one (`stock_server`). Stopped by
    `close()`."""

    def __init__(self, keep: int = 2,
                 start: Callable[[Path, int, str], ServerProcess] = stock_server) -> None:
        self.keep, self.start = keep, start
        self.servers: dict[tuple[str, int, str], ServerProcess] = {}

    def server_for(self, model_path: Path, page_size: int, dtype: str) -> ServerProcess:
        """The kept server of these settings (one whose tree lost a process is replaced), else
        a new one, the least recently used stopped to make room; the most recently used last."""
        key = (str(model_path), page_size, dtype)
        server = self.servers.pop(key, None)
        if server is not None and not server.tree_intact():
            server.stop()
            server = None
        if server is None:
            while len(self.servers) >= self.keep:
                self.servers.pop(next(iter(self.servers))).stop()
            server = self.start(model_path, page_size, dtype)
        self.servers[key] = server
        return server

    def __call__(self, model_path: Path, jobs: list[tuple[list[list[int]], int]], *,
                 page_size: int, dtype: str = "bfloat16") -> list[list[list[int]]]:
        server = self.server_for(model_path, page_size, dtype)
        try:
            return server_batches(model_path, jobs, page_size=page_size, dtype=dtype,
                                  server=server)
        except BaseException:  # a server that failed a batch is not kept
            self.servers.pop((str(model_path), page_size, dtype)).stop()
            raise

    def close(self) -> None:
        while self.servers:
            self.servers.popitem()[1].stop()


def generate_http(base_url: str, input_ids: list[int], max_new_tokens: int,
                  timeout_s: float = 1200.0) -> list[int]:
    """One greedy /generate request to a server; returns the output token ids."""
    resp = httpx.post(base_url + "/generate", timeout=timeout_s, json={
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                            "ignore_eos": True}})
    resp.raise_for_status()
    return list(resp.json()["output_ids"])


def generate_batch(base_url: str, input_ids: list[list[int]], max_new_tokens: int,
                   timeout_s: float = 1200.0) -> list[list[int] | BaseException]:
    """The requests as one batched /generate request: SGLang's tokenizer manager sends token-id
    batches to the scheduler in one message, so they reach the same admission pass however
    loaded the machine is (separate HTTP requests may arrive steps apart)."""
    try:
        resp = httpx.post(base_url + "/generate", timeout=timeout_s, json={
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}})
        resp.raise_for_status()
        answers = resp.json()
    except BaseException as exc:  # reported to the caller as each request's result
        return [exc] * len(input_ids)
    return [list(answer["output_ids"]) for answer in answers]


#: Largest logprob gap (nats) between two tokens that still counts as a tie where a served
#: greedy output parts from its reference. A request that was retracted and re-prefilled, or
#: batched differently, computes its KV with other matmul shapes, which round bf16/fp16
#: differently; on a random-weight model (near-flat next-token distributions) that flips near-ties.
#: A wrong slot or a page written by a neighbour gives gaps of whole nats.
#: bf16 logits between 4 and 8 are 2^-5 = 0.031 nats apart, so two roundings differ by 0.0625
#: (a rehearsal of the suite at 0.05 failed on exactly that: -4.2332 vs -4.2957).
TIE_NATS = 0.07
TOP_K = 64


def next_token_logprobs(base_url: str, input_ids: list[int]) -> dict[int, float]:
    """The server's top-`TOP_K` logprobs of the token after `input_ids`."""
    resp = httpx.post(base_url + "/generate", timeout=600, json={
        "input_ids": input_ids, "return_logprob": True, "top_logprobs_num": TOP_K,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
    resp.raise_for_status()
    top = resp.json()["meta_info"]["output_top_logprobs"][0]
    return {int(tok): float(lp) for lp, tok, _ in top}


def tie_problem(base_url: str, prompt: list[int], want: list[int],
                have: list[int] | BaseException) -> str | None:
    """None if `have` equals `want` or parts from it at a tie (judged by the server on the
    shared prefix); else what is wrong."""
    if isinstance(have, BaseException):
        return f"request failed: {have!r}"
    if have == want:
        return None
    if len(have) != len(want):
        return f"{len(have)} tokens, expected {len(want)}"
    first = next(i for i, (w, h) in enumerate(zip(want, have, strict=True)) if w != h)
    top = next_token_logprobs(base_url, prompt + want[:first])
    a, b = top.get(want[first]), top.get(have[first])
    if a is None or b is None or abs(a - b) > TIE_NATS:
        return (f"parts at token {first}: {want[first]} (logprob {a}) vs {have[first]} "
                f"(logprob {b}), not a tie within {TIE_NATS} nats")
    return None


def generate_concurrently(base_url: str, input_ids: list[list[int]], max_new_tokens: int
                          ) -> list[list[int] | BaseException]:
    """All requests at once, one thread each; an exception stands in for a failed request."""
    results: list[list[int] | BaseException] = [RuntimeError("not run")] * len(input_ids)

    def one(i: int) -> None:
        try:
            results[i] = generate_http(base_url, input_ids[i], max_new_tokens)
        except BaseException as exc:  # reported to the caller as a result
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(input_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@dataclass
class UsageSampler:
    """Samples per-runtime used bytes from the slab table in a background thread."""

    arena: ScratchArena
    period_s: float = 0.02
    peaks: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> UsageSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            usage = self.arena.used_bytes()
            for rid, used in usage.items():
                self.peaks[rid] = max(self.peaks.get(rid, 0), used)
            if not self.timeline or self.timeline[-1][1] != usage:
                self.timeline.append((time.monotonic() - start, usage))
            time.sleep(self.period_s)

    def describe(self, every_s: float = 1.0) -> str:
        """The usage timeline, a line per `every_s` (and the last), in % of the arena."""
        lines, next_s = [], 0.0
        for i, (t, usage) in enumerate(self.timeline):
            if t >= next_s or i == len(self.timeline) - 1:
                shares = " ".join(f"{rid} {used / self.arena.arena_bytes:4.0%}"
                                  for rid, used in sorted(usage.items()))
                lines.append(f"  {t:7.2f} s  {shares}")
                next_s = t + every_s
        return "\n".join(lines)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def peak_fraction(self, runtime_id: str, arena_bytes: int | None = None) -> float:
        return self.peaks.get(runtime_id, 0) / (arena_bytes or self.arena.arena_bytes)


#: Stock outputs' folder on disk (see StockOutputs); empty: memory only.
STOCK_CACHE_VAR = "FINESLAB_STOCK_CACHE"
#: How the CPU mode computes half-precision products (`sgl_kernel/gemm_cpu.py`), part of a
#: stock output's key: outputs computed by torch's own loops are not reused under the fp32 kernel.
BF16_PRODUCTS = "rows4-v2-" + os.environ.get("FINESLAB_CPU_HALF_GEMM", "default")


def model_checksum(model_dir: Path) -> str:
    """A digest of the model's files (weights, config, tokenizer)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class StockOutputs:
    """Greedy outputs of SGLang's own pool for (model, page size, dtype, prompts, new tokens):
    the identity and co-location tests compare against the same runs. `prefetch` computes
    several batches of one model in one engine."""

    def __init__(self, model_cache: Path, folder: Path | None,
                 compute: Callable[..., list[list[list[int]]]] | None = None) -> None:
        self.model_cache = model_cache
        self.compute = compute or server_batches
        self.folder = folder
        self.cache: dict[tuple[object, ...], list[list[int]]] = {}
        self._checksums: dict[str, str] = {}
        self.computed = 0  # batches computed by an engine (not read from disk)

    def __call__(self, model: str, page_size: int, dtype: str,
                 input_ids: tuple[tuple[int, ...], ...], max_new_tokens: int) -> list[list[int]]:
        self.prefetch(model, page_size, dtype, [(input_ids, max_new_tokens)])
        return self.cache[(model, page_size, dtype, input_ids, max_new_tokens)]

    def prefetch(self, model: str, page_size: int, dtype: str,
                 jobs: list[tuple[tuple[tuple[int, ...], ...], int]]) -> None:
        missing = [(ids, n) for ids, n in jobs
                   if (model, page_size, dtype, ids, n) not in self.cache
                   and not self._load(model, page_size, dtype, ids, n)]
        if not missing:
            return
        outputs = self.compute(self.model_cache / model,
                                 [([list(p) for p in ids], n) for ids, n in missing],
                                 page_size=page_size, dtype=dtype)
        self.computed += len(missing)
        for (ids, n), out in zip(missing, outputs, strict=True):
            self.cache[(model, page_size, dtype, ids, n)] = out
            self._store(model, page_size, dtype, ids, n, out)

    def _path(self, model: str, page_size: int, dtype: str, ids: tuple[tuple[int, ...], ...],
              n: int) -> Path | None:
        if self.folder is None:
            return None
        if model not in self._checksums:
            self._checksums[model] = model_checksum(self.model_cache / model)
        key = json.dumps([metadata.version("sglang"), self._checksums[model], page_size, dtype,
                          ids, n, BF16_PRODUCTS])
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def _load(self, model: str, page_size: int, dtype: str, ids: tuple[tuple[int, ...], ...],
              n: int) -> bool:
        path = self._path(model, page_size, dtype, ids, n)
        try:
            outputs = json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return False
        if not isinstance(outputs, list) or len(outputs) != len(ids):
            return False
        self.cache[(model, page_size, dtype, ids, n)] = outputs
        return True

    def _store(self, model: str, page_size: int, dtype: str, ids: tuple[tuple[int, ...], ...],
               n: int, outputs: list[list[int]]) -> None:
        path = self._path(model, page_size, dtype, ids, n)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(outputs))
        tmp.replace(path)

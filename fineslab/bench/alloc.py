"""Benchmark: per-page cost of the slab allocator against SGLang's own paged allocator.

    python -m fineslab.bench.alloc [--json] [--steps N] [--page-size 16] [--repeats 3]
                                   [--device cpu|cuda]

Both replay the same operation list, the pattern SGLang's scheduler produces: a new request
allocates its prompt's pages in one batch (prefill), a running request allocates one page each
time its length crosses a page boundary (decode), a finished request frees all its pages.
Baseline: `PagedTokenToKVPoolAllocator` constructed as SGLang's KVCacheConfigurator does (size in
tokens, page size, need_sort=False outside PD disaggregation), private to one process; alloc
via `alloc(num_pages * page_size)` (token indices), free via `free_segment` (its cheapest free of
whole pages: no torch.unique).
Slab: each process a `RuntimeSlabs` on one table shared by both, behind `SlabTokenAdapter`, the
same token-index interface (`slab_raw_ns_per_page`: block ids only); and each process a
`PooledSlabs` in one key pool shared by both (`slab_pooled_ns_per_page`: the price of key
pools; with its block cache, as the plugin has it, most calls take no lock:
`pooled_locked_share` is the share of its calls that took the table lock).
Two processes run at once, each replaying its own op list through its private SGLang allocator,
then through its RuntimeSlabs, interleaved (--repeats rounds, the first allocator rotating), so
both allocators see the same CPU contention (this 2-core machine is shared) and only the slab
one shares a table. Each figure is the median over the rounds; each ratio is the median of the
round-by-round ratios, with its spread (`*_spread`: median, min, max, n).
Result: ns per allocated page, including the page's free, averaged over the two processes,
two ways:
    CPU time (`*_ns_per_page`, `ratio`, `pooled_ratio_cpu`): user + system, so time a process
        spends descheduled on a loaded machine does not count, nor does waiting on a lock
    wall time (`*_wall_ns_per_page`, `ratio_wall`, `pooled_ratio`): what a runtime waits,
        the key pool's lock included (issue #18 measures key pools this way)
ratio = slab / sglang (target <= 1.5); pooled_ratio = key pool / sglang (target <= 1.5).

`--device cuda` puts both on a GPU as a runtime there has them: SGLang's free pages and the
token indices it returns live on the device, and the adapter does what `SlabAllocator` does
there (the block ids cross to the device, the token indices are made there, the freed ids come
back to the host: one small copy each way). Time is then wall time up to a device synchronize,
since waiting for the device is the cost in question and a driver that blocks rather than spins
would hide it from CPU time. The block-ids-only replay (`slab_raw`) never touches the device.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineslab.bench.repeats import interleave, ratios, spread
from fineslab.tables import add_json_flag, emit

ALLOC, FREE = 0, 1
NUM_PROCESSES = 2
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ReplaySpec:
    """What each process replays (its op list of `num_steps` scheduler steps), how often, where."""

    num_steps: int
    page_size: int
    pool_pages: int
    repeats: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if min(self.num_steps, self.page_size, self.pool_pages, self.repeats) <= 0:
            raise ValueError("steps, page size, pool pages and repeats must be positive")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is none of {DEVICES}")


@dataclass(frozen=True)
class OpList:
    kinds: list[int]
    requests: list[int]
    num_pages: list[int]

    @property
    def total_pages(self) -> int:
        return sum(n for k, n in zip(self.kinds, self.num_pages, strict=True) if k == ALLOC)


def make_ops(num_steps: int, page_size: int, seed: int, concurrency: int = 48) -> OpList:
    """A scheduler-like sequence of prefill batches, decode pages and request frees."""
    rng = np.random.default_rng(seed)
    ops: list[tuple[int, int, int]] = []  # (kind, request, pages)
    live: dict[int, int] = {}  # request -> tokens
    next_request = 0
    for _ in range(num_steps):
        if len(live) < concurrency:
            tokens = int(rng.integers(32, 2048))
            live[next_request] = tokens
            ops.append((ALLOC, next_request, -(-tokens // page_size)))
            next_request += 1
            continue
        request = list(live)[int(rng.integers(len(live)))]
        if rng.random() < 1 / 256:
            del live[request]
            ops.append((FREE, request, 0))
            continue
        live[request] += 1
        if live[request] % page_size == 1:
            ops.append((ALLOC, request, 1))
    ops += [(FREE, request, 0) for request in live]
    kinds, requests, pages = (list(column) for column in zip(*ops, strict=True))
    return OpList(kinds, requests, pages)


class ReplayClock:
    """Seconds of one replay, both ways: process CPU time on the CPU (wall time to a
    synchronize on CUDA), and wall time, which counts a process waiting on the table lock."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._start = self._start_wall = 0.0

    def _sync(self) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self._start, self._start_wall = time.process_time(), time.perf_counter()

    def seconds(self) -> tuple[float, float]:
        """(CPU seconds on the CPU or wall seconds on CUDA, wall seconds)."""
        self._sync()
        wall = time.perf_counter() - self._start_wall
        return (time.process_time() - self._start if self.device == "cpu" else wall), wall


def replay_sglang(ops: OpList, page_size: int, pool_pages: int, device: str = "cpu"
                  ) -> tuple[float, float]:
    """Seconds (`ReplayClock.seconds`) to replay `ops` through SGLang's
    PagedTokenToKVPoolAllocator on `device`."""
    if device == "cpu":
        from fineslab import cpu_mode

        cpu_mode.activate()
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    allocator = PagedTokenToKVPoolAllocator(pool_pages * page_size, page_size=page_size,
                                            dtype=torch.bfloat16, device=device, kvcache=None,
                                            need_sort=False)
    held: dict[int, list[torch.Tensor]] = {}
    clock = ReplayClock(device)
    clock.start()
    for kind, request, num_pages in zip(ops.kinds, ops.requests, ops.num_pages, strict=True):
        if kind == ALLOC:
            indices = allocator.alloc(num_pages * page_size)
            if indices is None:
                raise RuntimeError("baseline pool too small for the op list")
            held.setdefault(request, []).append(indices)
        else:
            allocator.free_segment(torch.cat(held.pop(request)), start_pos=0)
    return clock.seconds()


class SlabTokenAdapter:
    """What the plugin does around RuntimeSlabs: token indices in and out, as SGLang expects.

    alloc: block ids -> token indices `page * page_size + offset`; free: token indices of whole
    pages -> page ids `indices[::page_size] // page_size`, the same reduction SGLang's own
    `free_segment` does. On the CPU in numpy (then torch.from_numpy); on CUDA as
    `SlabAllocator` does it there: ids to the device, indices made there, freed ids back.
    """

    def __init__(self, runtime: object, page_size: int, device: str = "cpu") -> None:
        import torch

        from fineslab.slabs.client import RuntimeSlabs
        from fineslab.slabs.pooled import PooledSlabs

        assert isinstance(runtime, RuntimeSlabs | PooledSlabs)
        self.runtime, self.page_size, self.device = runtime, page_size, device
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._device_offsets = torch.arange(page_size, dtype=torch.int64, device=device)

    def alloc(self, num_pages: int) -> object:
        import torch

        pages = self.runtime.alloc_array(num_pages)
        if self.device == "cpu":
            return torch.from_numpy((pages[:, None] * self.page_size + self._offsets).reshape(-1))
        ids = torch.from_numpy(pages).to(self.device)
        return (ids[:, None] * self.page_size + self._device_offsets).reshape(-1)

    def free(self, token_indices: object) -> None:
        import torch

        assert isinstance(token_indices, torch.Tensor)
        if self.device == "cpu":
            self.runtime.free(token_indices.numpy()[:: self.page_size] // self.page_size)
        else:
            page_ids = token_indices[:: self.page_size] // self.page_size
            self.runtime.free(page_ids.cpu().numpy())


def replay_slab(ops: OpList, runtime: object, page_size: int, to_torch: bool,
                device: str = "cpu") -> tuple[float, float]:
    """Seconds (`ReplayClock.seconds`) to replay `ops` through a RuntimeSlabs or PooledSlabs,
    with the plugin's token adapter on `device` or not (block ids only: as on the CPU,
    whatever the device)."""
    import torch

    from fineslab.slabs.client import RuntimeSlabs
    from fineslab.slabs.pooled import PooledSlabs

    assert isinstance(runtime, RuntimeSlabs | PooledSlabs)
    adapter = SlabTokenAdapter(runtime, page_size, device)
    held: dict[int, list] = {}
    clock = ReplayClock(device if to_torch else "cpu")
    clock.start()
    if to_torch:
        for kind, request, num_pages in zip(ops.kinds, ops.requests, ops.num_pages,
                                            strict=True):
            if kind == ALLOC:
                held.setdefault(request, []).append(adapter.alloc(num_pages))
            else:
                adapter.free(torch.cat(held.pop(request)))
    else:
        for kind, request, num_pages in zip(ops.kinds, ops.requests, ops.num_pages,
                                            strict=True):
            if kind == ALLOC:
                held.setdefault(request, []).append(runtime.alloc_array(num_pages))
            else:
                runtime.free(np.concatenate(held.pop(request)))
    return clock.seconds()

def _bench_format(page_size: int) -> object:
    from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape

    return BlockFormat.unpadded(KVShape("tiny-bf16", 4, 2, 64, KVDtype.BF16), page_size)


def _worker(shm_dir: str, index: int, spec: ReplaySpec,
            barrier: mp.synchronize.Barrier, queue: mp.Queue) -> None:
    """Replay the op list alternately through a private SGLang allocator and the shared table."""
    from fineslab.slabs.client import RuntimeSlabs
    from fineslab.slabs.formats import BlockFormat
    from fineslab.slabs.pooled import PooledSlabs

    page_size, device = spec.page_size, spec.device
    ops = make_ops(spec.num_steps, page_size, seed=index)
    fmt = _bench_format(page_size)
    assert isinstance(fmt, BlockFormat)
    runtime = RuntimeSlabs.attach("bench-alloc", "cpu0", f"rt{index}", fmt, Path(shm_dir))
    pooled = PooledSlabs.attach("bench-alloc", "cpu0", f"pool{index}", fmt, Path(shm_dir))
    # Warm-up: imports, first-call costs and, on CUDA, the context and its first kernels.
    replay_sglang(ops, page_size, spec.pool_pages, device)
    replay_slab(ops, runtime, page_size, to_torch=True, device=device)
    replay_slab(ops, pooled, page_size, to_torch=True, device=device)
    def replay(kind: str, _round: int) -> tuple[float, float]:
        barrier.wait()  # both processes run the same allocator at the same time
        if kind == "sglang":
            return replay_sglang(ops, page_size, spec.pool_pages, device)
        return replay_slab(ops, pooled if kind == "slab_pooled" else runtime, page_size,
                           to_torch=kind != "slab_raw", device=device)

    # Interleaved, the first allocator rotating from repeat to repeat (in both processes alike).
    times = interleave({kind: functools.partial(replay, kind) for kind in KINDS}, spec.repeats)
    per_page = {name: [t[wall] / ops.total_pages for t in times[kind]]
                for kind in KINDS for wall, name in ((0, kind), (1, f"{kind}_wall"))}
    runtime.check_integrity()
    pooled.check_integrity()
    locked = pooled.num_locked_calls / (len(ops.kinds) * (spec.repeats + 1))
    runtime.close()
    pooled.close()
    queue.put((per_page, locked, ops.total_pages, len(ops.kinds)))


#: The allocators replayed, each repeat: SGLang's, the slab table's with and without the token
#: adapter, and a key pool's.
KINDS = ("sglang", "slab", "slab_raw", "slab_pooled")


def run(spec: ReplaySpec) -> tuple[dict[str, list[float]], float, int, int]:
    """Seconds per page of each allocator (CPU time; `<kind>_wall`: wall time), one per repeat,
    averaged over the processes; the key pool's locked share; pages and ops per replay."""
    from fineslab.slabs.arena import ArenaSpec, SlabArena
    from fineslab.slabs.formats import BlockFormat

    fmt = _bench_format(spec.page_size)
    assert isinstance(fmt, BlockFormat)
    blocks_per_slab = 64
    slab_bytes = blocks_per_slab * fmt.block_stride_bytes
    num_slabs = NUM_PROCESSES * spec.pool_pages // blocks_per_slab
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as shm_dir:
        # The slab table is host memory whatever the device: only the token indices move.
        arena = ArenaSpec("bench-alloc", "cpu0", num_slabs * slab_bytes, slab_bytes,
                          blocks_per_slab)
        with SlabArena.create(arena, shm_dir=Path(shm_dir)):
            barrier, queue = ctx.Barrier(NUM_PROCESSES), ctx.Queue()
            workers = [ctx.Process(target=_worker, args=(shm_dir, i, spec, barrier, queue))
                       for i in range(NUM_PROCESSES)]
            for worker in workers:
                worker.start()
            results = [queue.get(timeout=900) for _ in workers]
            for worker in workers:
                worker.join()
    means = {name: [float(np.mean([r[0][name][i] for r in results]))
                    for i in range(spec.repeats)] for name in results[0][0]}
    locked = float(np.mean([r[1] for r in results]))
    return means, locked, sum(r[2] for r in results), sum(r[3] for r in results)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.alloc",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60_000, help="scheduler steps replayed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved replays of each allocator (medians and spreads)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where SGLang's free pages and the token indices live")
    add_json_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.device == "cuda":
        from fineslab import cpu_mode

        if not cpu_mode.cuda_available():
            raise SystemExit("fineslab.bench.alloc --device cuda: torch sees no CUDA device")
    spec = ReplaySpec(args.steps, args.page_size, 16_384, args.repeats, args.device)
    seconds, locked, num_pages, num_ops = run(spec)
    ns = {name: spread([s * 1e9 for s in values], 1) for name, values in seconds.items()}

    def ratio(of: str, to: str) -> dict[str, float]:
        """Repeat by repeat (the two ran back to back), median and spread."""
        return spread(ratios(seconds[of], seconds[to]), 3)

    ratio_figures = {"ratio": ratio("slab", "sglang"),
                     "pooled_ratio_cpu": ratio("slab_pooled", "sglang"),
                     # wall time: a process waiting for the key pool's lock counts (issue #18)
                     "ratio_wall": ratio("slab_wall", "sglang_wall"),
                     "pooled_ratio": ratio("slab_pooled_wall", "sglang_wall")}
    sglang_ns, slab_ns, slab_raw_ns, pooled_ns = (
        ns[k]["median"] for k in ("sglang", "slab", "slab_raw", "slab_pooled"))
    sglang_wall_ns, slab_wall_ns, pooled_wall_ns = (
        ns[f"{k}_wall"]["median"] for k in ("sglang", "slab", "slab_pooled"))
    result = {
        "slab_ns_per_page": slab_ns, "slab_raw_ns_per_page": slab_raw_ns,
        "sglang_ns_per_page": sglang_ns, "slab_pooled_ns_per_page": pooled_ns,
        "sglang_wall_ns_per_page": sglang_wall_ns, "slab_wall_ns_per_page": slab_wall_ns,
        "slab_pooled_wall_ns_per_page": pooled_wall_ns,
        **{name: figure["median"] for name, figure in ratio_figures.items()},
        **{f"{name}_spread": figure for name, figure in ratio_figures.items()},
        "ns_per_page_spread": ns,
        "pooled_locked_share": round(locked, 4),
        "pages_per_replay": num_pages, "ops_per_replay": num_ops, "repeats": args.repeats,
        "page_size": args.page_size, "processes": NUM_PROCESSES, "device": args.device,
    }
    # "vs sglang" as the JSON has it: the median of the round-by-round ratios
    vs = {name: figure["median"] for name, figure in ratio_figures.items()}
    vs["slab_raw"] = ratio("slab_raw", "sglang")["median"]
    rows = [
        ["sglang PagedTokenToKVPoolAllocator (private)", sglang_ns, 1.0],
        ["slab RuntimeSlabs + token adapter (shared table)", slab_ns, vs["ratio"]],
        ["slab RuntimeSlabs, block ids only (shared table)", slab_raw_ns, vs["slab_raw"]],
        ["slab PooledSlabs + token adapter (one key pool)", pooled_ns, vs["pooled_ratio_cpu"]],
        ["wall: sglang (private)", sglang_wall_ns, 1.0],
        ["wall: slab RuntimeSlabs + token adapter", slab_wall_ns, vs["ratio_wall"]],
        ["wall: slab PooledSlabs + token adapter", pooled_wall_ns, vs["pooled_ratio"]],
    ]
    emit(f"Allocator cost per page on {args.device}, {NUM_PROCESSES} processes at once "
         f"({num_pages} pages, {num_ops} ops, page size {args.page_size}), median of "
         f"{args.repeats} interleaved replays (ratios' spread: `*_spread` in the JSON)",
         ["allocator", "ns/page", "vs sglang"], rows, result, args.json)


if __name__ == "__main__":
    main()

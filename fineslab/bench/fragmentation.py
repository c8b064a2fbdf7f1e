"""Benchmark: how much of a fixed arena holds live KV when four mixed-precision models share it.

    python -m fineslab.bench.fragmentation [TRACE] [--json] [--arena-gib 8] [--tpot-s 0.05]

Workload: the requests of TRACE (default /work/shared/traces/splitwise_conv.csv: arrival time,
prefill tokens, decode tokens), dealt round-robin to four co-located models whose token sizes
differ: Llama-3-8B BF16 KV, Llama-3-8B FP8 KV, Qwen2.5-7B INT4 KV (QoQ KV4) and a TP=2 shard of
Llama-3-70B BF16 KV. A request takes its prompt's blocks at arrival (one batch), then one token
every --tpot-s seconds (a new block each time a block fills), and frees everything when its last
token is out. When an allocation fails, that request is dropped (its blocks freed) and the run
goes on. Every scheme replays the same requests at the same times into the same arena bytes:

  slab         fineslab: SlabTable + one RuntimeSlabs per model, slab size from plan_slabs;
               a decode block is allocated with the request's last block as `near_block`
  static       one fixed partition per model, sized in proportion to that model's time-averaged
               KV demand in this very trace (an oracle: the best a static split can do)
  fixed_block  one shared pool of uniform blocks, sized for the largest model's block; a smaller
               model packs more tokens into each block (its page grows)
  first_fit    variable-size blocks (each model's own block bytes) placed first-fit in one byte
               range, no slabs, no alignment (generous: SGLang's flat slot indexing would need
               each block at a multiple of its size, which `first_fit_aligned` models)

Every scheme uses the slab plan's tokens-per-block per model; only slab pays padding. Utilization
= live KV bytes (tokens held x that model's real token bytes) / arena bytes, at the first failed
allocation (the keys `slab`, `static`, ...), averaged over all failures (`*_at_failures`), and
averaged over time (`*_time_avg`, 2,000 samples).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from fineslab.bench.report import add_json_flag, emit
from fineslab.errors import ArenaExhausted
from fineslab.slabs.client import RuntimeSlabs
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape
from fineslab.slabs.sizing import plan_slabs
from fineslab.slabs.table import SlabTable, TableDims

DEFAULT_TRACE = Path("/work/shared/traces/splitwise_conv.csv")
GIB = 1 << 30
MODELS = (
    KVShape("llama3-8b-bf16", 32, 8, 128, KVDtype.BF16),
    KVShape("llama3-8b-fp8kv", 32, 8, 128, KVDtype.FP8_E4M3),
    KVShape("qwen2.5-7b-int4kv", 28, 4, 128, KVDtype.INT4),
    KVShape("llama3-70b-tp2-bf16", 80, 8, 128, KVDtype.BF16, tp_size=2),
)
NUM_SAMPLES = 2000


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    model: np.ndarray
    token_bytes: np.ndarray  # per model
    tpot_s: float

    @classmethod
    def load(cls, path: Path, tpot_s: float) -> Workload:
        rows = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
        model = np.arange(len(rows)) % len(MODELS)
        token_bytes = np.array([m.token_bytes for m in MODELS], dtype=np.int64)
        return cls(rows[:, 0], rows[:, 1].astype(np.int64), rows[:, 2].astype(np.int64), model,
                   token_bytes, tpot_s)

    @property
    def end_s(self) -> np.ndarray:
        return self.arrival_s + self.decode_tokens * self.tpot_s

    def live_bytes(self, t: float, alive: np.ndarray) -> float:
        """Real KV bytes held at time t by requests not dropped."""
        live = alive & (self.arrival_s <= t) & (self.end_s > t)
        decoded = np.clip(np.floor((t - self.arrival_s[live]) / self.tpot_s), 0,
                          self.decode_tokens[live])
        tokens = self.prefill_tokens[live] + decoded
        return float(tokens @ self.token_bytes[self.model[live]])


def block_events(work: Workload, tokens_per_block: np.ndarray) -> tuple[np.ndarray, ...]:
    """(time, kind 0=alloc 1=free, request, num_blocks), sorted by time, allocs first."""
    tpb = tokens_per_block[work.model]
    first = -(-work.prefill_tokens // tpb)
    total = -(-(work.prefill_tokens + work.decode_tokens) // tpb)
    requests = np.arange(len(tpb))
    extra = total - first
    grow_req = np.repeat(requests, extra)
    block_index = np.arange(extra.sum()) - np.repeat(np.cumsum(extra) - extra, extra) + \
        first[grow_req]
    grow_t = work.arrival_s[grow_req] + (block_index * tpb[grow_req] + 1 -
                                         work.prefill_tokens[grow_req]) * work.tpot_s
    times = np.concatenate([work.arrival_s, grow_t, work.end_s])
    kinds = np.concatenate([np.zeros(len(tpb) + len(grow_t), np.int8), np.ones(len(tpb), np.int8)])
    reqs = np.concatenate([requests, grow_req, requests])
    counts = np.concatenate([first, np.ones(len(grow_t), np.int64), np.zeros(len(tpb), np.int64)])
    order = np.lexsort((kinds, times))
    return times[order], kinds[order], reqs[order], counts[order]


class Scheme(Protocol):
    """An arena allocator under test: a handle per successful alloc, None when it fails."""

    def alloc(self, model: int, num_blocks: int, previous: object | None) -> object | None:
        """`previous`: the request's last handle (None for its prompt)."""

    def free(self, model: int, handles: list[object]) -> None: ...


class SlabScheme:
    """fineslab's mechanism itself: a SlabTable (table file only) and one RuntimeSlabs a model."""

    def __init__(self, arena_bytes: int, slab_bytes: int, formats: list[BlockFormat],
                 folder: Path) -> None:
        max_bps = max(f.blocks_per_slab(slab_bytes) for f in formats)
        dims = TableDims(arena_bytes // slab_bytes, slab_bytes, max_bps, max_runtimes=8)
        self.table = SlabTable.create(folder / "fragmentation.table", dims, backing=0)
        self.clients = [RuntimeSlabs(self.table, f.name, f) for f in formats]

    def alloc(self, model: int, num_blocks: int, previous: object | None) -> object | None:
        near = int(previous[-1]) if isinstance(previous, np.ndarray) and previous.size else None
        try:
            return self.clients[model].alloc_array(num_blocks, near_block=near)
        except ArenaExhausted:
            return None

    def free(self, model: int, handles: list[object]) -> None:
        if handles:
            self.clients[model].free(np.concatenate(handles))  # type: ignore[arg-type]

    def close(self) -> None:
        for client in self.clients:
            client.check_integrity()
            client.close()
        self.table.close()


class CountingScheme:
    """Pools of uniform blocks (no fragmentation inside a pool): static or one shared pool."""

    def __init__(self, capacity_blocks: list[int], pool_of_model: list[int]) -> None:
        self.capacity, self.pool_of = capacity_blocks, pool_of_model
        self.used = [0] * len(capacity_blocks)

    def alloc(self, model: int, num_blocks: int, previous: object | None) -> object | None:
        pool = self.pool_of[model]
        if self.used[pool] + num_blocks > self.capacity[pool]:
            return None
        self.used[pool] += num_blocks
        return num_blocks

    def free(self, model: int, handles: list[object]) -> None:
        self.used[self.pool_of[model]] -= sum(handles)  # type: ignore[arg-type]


class FirstFitScheme:
    """Variable-size blocks, first fit in address order over a sorted list of holes."""

    def __init__(self, arena_bytes: int, block_bytes: list[int], aligned: bool) -> None:
        self.block_bytes, self.aligned = block_bytes, aligned
        self.starts = np.array([0], dtype=np.int64)
        self.sizes = np.array([arena_bytes], dtype=np.int64)

    def alloc(self, model: int, num_blocks: int, previous: object | None) -> object | None:
        size = self.block_bytes[model]
        starts, sizes = self.starts, self.sizes
        first = -(-starts // size) * size if self.aligned else starts
        fit = np.maximum((starts + sizes - first) // size, 0)
        total = np.cumsum(fit)
        if total.size == 0 or total[-1] < num_blocks:
            return None
        last = int(np.searchsorted(total, num_blocks))
        take = fit[: last + 1].copy()
        take[last] -= total[last] - num_blocks
        used = np.flatnonzero(take)
        chunk_starts, chunk_sizes = first[used], take[used] * size
        hole_ends = starts[used] + sizes[used]
        left = (starts[used], chunk_starts - starts[used])
        right = (chunk_starts + chunk_sizes, hole_ends - chunk_starts - chunk_sizes)
        keep = np.ones(starts.size, dtype=bool)
        keep[used] = False
        new_starts = np.concatenate([starts[keep], left[0], right[0]])
        new_sizes = np.concatenate([sizes[keep], left[1], right[1]])
        order = np.argsort(new_starts[new_sizes > 0], kind="stable")
        self.starts, self.sizes = new_starts[new_sizes > 0][order], new_sizes[new_sizes > 0][order]
        return list(zip(chunk_starts.tolist(), chunk_sizes.tolist(), strict=True))

    def free(self, model: int, handles: list[object]) -> None:
        chunks = sorted(c for handle in handles for c in handle)  # type: ignore[attr-defined]
        if not chunks:
            return
        starts = np.concatenate([self.starts, [c[0] for c in chunks]])
        sizes = np.concatenate([self.sizes, [c[1] for c in chunks]])
        order = np.argsort(starts, kind="stable")
        starts, sizes = starts[order], sizes[order]
        # coalesce: a hole starts a new run unless it begins where the previous one ends
        ends = starts + sizes
        if (starts[1:] < ends[:-1]).any():
            raise RuntimeError("first-fit baseline: a freed chunk overlaps a hole (a defect)")
        new_run = np.ones(starts.size, dtype=bool)
        new_run[1:] = starts[1:] != ends[:-1]
        run_id = np.cumsum(new_run) - 1
        self.starts = starts[new_run]
        self.sizes = np.bincount(run_id, weights=sizes).astype(np.int64)


@dataclass(frozen=True)
class Outcome:
    first_failure_util: float | None
    first_failure_s: float | None
    failure_utils: tuple[float, ...]
    time_avg_util: float
    num_dropped: int


def replay(work: Workload, events: tuple[np.ndarray, ...], scheme: Scheme,
           arena_bytes: int) -> Outcome:
    """Run the events through `scheme`, dropping a request whose allocation fails."""
    alive = np.ones(work.arrival_s.size, dtype=bool)
    held: dict[int, list[object]] = {}
    samples = np.linspace(0.0, float(work.end_s.max()), NUM_SAMPLES)
    sampled: list[float] = []
    failures: list[tuple[float, float]] = []
    times, kinds, reqs, counts = (e.tolist() for e in events)
    models = work.model.tolist()
    for t, kind, request, num_blocks in zip(times, kinds, reqs, counts, strict=True):
        while len(sampled) < NUM_SAMPLES and samples[len(sampled)] <= t:
            sampled.append(work.live_bytes(float(samples[len(sampled)]), alive))
        if not alive[request]:
            continue
        model = models[request]
        if kind == 1:
            scheme.free(model, held.pop(request, []))
            continue
        mine = held.get(request)
        handle = scheme.alloc(model, num_blocks, mine[-1] if mine else None)
        if handle is None:
            # what is held: all live tokens but those this allocation was for (the prompt, or
            # the one decode token that opened a new block)
            unheld = work.prefill_tokens[request] if request not in held else 1
            held_bytes = work.live_bytes(t, alive) - unheld * work.token_bytes[model]
            failures.append((t, held_bytes / arena_bytes))
            alive[request] = False
            scheme.free(model, held.pop(request, []))
            continue
        held.setdefault(request, []).append(handle)
    first = failures[0] if failures else None
    return Outcome(first[1] if first else None, first[0] if first else None,
                   tuple(u for _, u in failures), float(np.mean(sampled)) / arena_bytes,
                   int((~alive).sum()))


def mean_demand_bytes(work: Workload) -> np.ndarray:
    """Time-averaged live KV bytes of each model with no memory limit (static's oracle)."""
    demand = np.zeros(len(MODELS))
    everyone = np.ones(work.arrival_s.size, dtype=bool)
    for m in range(len(MODELS)):
        mine = everyone & (work.model == m)
        demand[m] = np.mean([work.live_bytes(float(t), mine)
                             for t in np.linspace(0, float(work.end_s.max()), 500)])
    return demand


def build_schemes(work: Workload, arena_bytes: int, folder: Path, page_sizes: tuple[int, ...]
                  ) -> tuple[dict[str, tuple[Scheme, np.ndarray]], list[BlockFormat], int]:
    """Each scheme with the tokens-per-block of each model it uses; the slab plan."""
    plan = plan_slabs(MODELS, page_sizes=page_sizes)
    formats = list(plan.formats)
    tpb = np.array([f.tokens_per_block for f in formats], dtype=np.int64)
    block_bytes = [f.block_bytes for f in formats]  # unpadded: baselines pay no padding
    share = mean_demand_bytes(work)
    share /= share.sum()
    static_caps = [int(arena_bytes * share[m] // block_bytes[m]) for m in range(len(MODELS))]
    uniform_bytes = max(block_bytes)
    uniform_tpb = np.array([uniform_bytes // m.token_bytes for m in MODELS], dtype=np.int64)
    schemes: dict[str, tuple[Scheme, np.ndarray]] = {
        "slab": (SlabScheme(arena_bytes, plan.slab_bytes, formats, folder), tpb),
        "static": (CountingScheme(static_caps, list(range(len(MODELS)))), tpb),
        "fixed_block": (CountingScheme([arena_bytes // uniform_bytes], [0] * len(MODELS)),
                        uniform_tpb),
        "first_fit": (FirstFitScheme(arena_bytes, block_bytes, aligned=False), tpb),
        "first_fit_aligned": (FirstFitScheme(arena_bytes, block_bytes, aligned=True), tpb),
    }
    return schemes, formats, plan.slab_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--arena-gib", type=float, default=8.0)
    parser.add_argument("--tpot-s", type=float, default=0.05, help="seconds per decode token")
    parser.add_argument("--page-sizes", default="16,32,64",
                        help="allowed tokens per block (smaller pages give smaller slabs)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    work = Workload.load(args.trace, args.tpot_s)
    arena_bytes = int(args.arena_gib * GIB)
    result: dict[str, object] = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        page_sizes = tuple(int(p) for p in args.page_sizes.split(","))
        schemes, formats, slab_bytes = build_schemes(work, arena_bytes, Path(folder), page_sizes)
        for name, (scheme, tpb) in schemes.items():
            outcome = replay(work, block_events(work, tpb), scheme, arena_bytes)
            if isinstance(scheme, SlabScheme):
                scheme.close()
            first = outcome.first_failure_util
            at_failures = float(np.mean(outcome.failure_utils)) if outcome.failure_utils else None
            result[name] = round(first, 4) if first is not None else None
            result[f"{name}_at_failures"] = round(at_failures, 4) if at_failures else None
            result[f"{name}_time_avg"] = round(outcome.time_avg_util, 4)
            result[f"{name}_dropped"] = outcome.num_dropped
            rows.append([name, first if first is not None else "-",
                         at_failures if at_failures is not None else "-",
                         outcome.time_avg_util, outcome.num_dropped,
                         outcome.first_failure_s if outcome.first_failure_s else "-"])
    result.update(slab_bytes=slab_bytes, arena_bytes=arena_bytes, tpot_s=args.tpot_s,
                  requests=int(work.arrival_s.size),
                  padding_waste={f.name: round(f.padding_waste, 5) for f in formats})
    plan_rows = [[f.name, f.token_bytes, f.token_stride_bytes, f.tokens_per_block,
                  f.padding_waste] for f in formats]
    emit(f"Slab plan: slab {slab_bytes / (1 << 20):.2f} MiB, arena {args.arena_gib} GiB",
         ["model", "token B", "stride B", "tokens/block", "padding waste"], plan_rows, {}, False)
    emit(f"Live KV / arena, {work.arrival_s.size} requests of {args.trace.name}, "
         f"tpot {args.tpot_s}s", ["scheme", "at 1st failure", "mean at failures", "time avg",
                                  "dropped", "1st failure s"], rows, result, args.json)


if __name__ == "__main__":
    main()

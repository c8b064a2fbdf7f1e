"""Benchmark: how much of a fixed arena holds live KV when four mixed-precision models share it.

    python -m fineslab.bench.fragmentation [--workload azure|sharegpt] [TRACE] [--json]
                                           [--arena-gib 8] [--tpot-s 0.05]

Workloads (both dealt round-robin to the four models of MODELS: Llama-3-8B BF16 KV, Llama-3-8B
FP8 KV, Qwen2.5-7B INT4 KV (QoQ KV4), a TP=2 shard of Llama-3-70B BF16 KV):

  azure      the rows of splitwise_conv.csv (arrival, prompt, output), prompts clipped to 8,192
  sharegpt   the ShareGPT length table (the simulator's: prompt <= 8192, output <= 1024), rows
             drawn with replacement, Poisson arrivals over --duration-s; the rate, unless given,
             is matched so the unconstrained mean KV demand equals the azure workload's

A request takes its prompt's blocks at arrival (one batch), then one token every --tpot-s
seconds (a new block when a block fills), and frees everything when its last token is out. A
refused allocation drops its request (its blocks freed); the run goes on. Every scheme replays
the same requests at the same times into the same arena bytes.

Schemes and what each must honor (a real implementation under SGLang; never worse than that):

  slab         fineslab itself: SlabTable + RuntimeSlabs per model, slab plan of plan_slabs
               (padded strides, whole slabs only: the arena's tail beyond the last slab is lost),
               decode blocks placed near the request's last block (the plugin's last_loc)
  static       one private pool per model, sized in proportion to that model's exact mean KV
               demand in this very run (an oracle; an operator without the trace does no better);
               no padding, the slab plan's page sizes
  fixed_block  one shared pool of uniform B-byte blocks. SGLang indexes a model's layer buffer
               by flat slot (k_buffer[layer][slot], one stride), so block b must be page b of
               every model's view: B = page x stride, stride >= token bytes, 16-byte aligned. A
               model whose token does not divide B pads its stride; the block's remainder
               B - page x token_bytes is lost in every block (`fixed_block_tokens`). Pages are at
               least the slab plan's smallest. Two B are tried and the better is the key:
               `fixed_block_largest` B = smallest page x the largest token (the paper's "single
               fixed block size"), `fixed_block_lowpad` the smallest 7-smooth B whose worst
               remainder is within plan_slabs' padding bound
  first_fit    variable-size blocks (each model's unpadded block) placed first-fit in address
               order in one byte range, no slabs; each block at a multiple of its own size,
               since page p of a model's flat view starts at p x page x token bytes (the key).
               `first_fit_unaligned` drops that rule: not servable by SGLang, shown for scale

Metric. Utilization = live KV bytes (tokens held x that model's real token bytes) / arena bytes.
A refusal is a *capacity* refusal when live bytes including the refused tokens exceed the arena
(no allocator could serve it) and a *fragmentation* refusal otherwise (the bytes were there, the
scheme had wasted them: padding, partly filled blocks, stranding, holes, partitions). Until the
first fragmentation refusal of any scheme every scheme has dropped exactly the same requests
(a capacity refusal is one for all), so the first one compares all at the same history.

  <scheme>              utilization just before its first fragmentation refusal (null: none)
  <scheme>_at_failures  mean utilization over all its fragmentation refusals
  <scheme>_time_avg     utilization averaged over the run (2,000 instants)
  <scheme>_first_refusal  utilization at its first refusal of either kind (the old key)
  <scheme>_first_failure_s, _first_failure_asked  when, and the refused bytes / arena bytes
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from fineslab.bench.report import add_json_flag, emit
from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.slabs.client import RuntimeSlabs
from fineslab.slabs.formats import DEFAULT_ALIGNMENT_BYTES, BlockFormat, KVDtype, KVShape
from fineslab.slabs.sizing import plan_slabs, smooth_numbers
from fineslab.slabs.table import SlabTable, TableDims
from fineslab.workload import (
    AZURE_CONV,
    SHAREGPT_STATS,
    load_arrival_trace,
    load_lengths,
    poisson_arrivals,
)

GIB = 1 << 30
MODELS = (
    KVShape("llama3-8b-bf16", 32, 8, 128, KVDtype.BF16),
    KVShape("llama3-8b-fp8kv", 32, 8, 128, KVDtype.FP8_E4M3),
    KVShape("qwen2.5-7b-int4kv", 28, 4, 128, KVDtype.INT4),
    KVShape("llama3-70b-tp2-bf16", 80, 8, 128, KVDtype.BF16, tp_size=2),
)
NUM_SAMPLES = 2000
MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS = 8192, 1024  # the simulator's caps (sim/experiments)
# a float tick like (a + k * tpot - a) / tpot can land just below k; this puts it back
_TICK_EPS = 1e-6


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    model: np.ndarray
    token_bytes: np.ndarray  # per model
    tpot_s: float

    @classmethod
    def of(cls, arrival_s: np.ndarray, prefill: np.ndarray, decode: np.ndarray,
           tpot_s: float, shapes: tuple[KVShape, ...] = MODELS) -> Workload:
        """Requests dealt round-robin over `shapes`."""
        token_bytes = np.array([m.token_bytes for m in shapes], dtype=np.int64)
        return cls(np.asarray(arrival_s, dtype=np.float64), np.asarray(prefill, dtype=np.int64),
                   np.asarray(decode, dtype=np.int64), np.arange(len(arrival_s)) % len(shapes),
                   token_bytes, tpot_s)

    @classmethod
    def azure(cls, path: Path, tpot_s: float) -> Workload:
        trace = load_arrival_trace(path, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
        return cls.of(trace.arrival_s, trace.lengths.prompt_tokens,
                      trace.lengths.output_tokens, tpot_s)

    @classmethod
    def sharegpt(cls, path: Path, tpot_s: float, rate_per_s: float, duration_s: float,
                 seed: int) -> Workload:
        lengths = load_lengths(path, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
        rng = np.random.default_rng(seed)
        arrival_s = poisson_arrivals(rate_per_s, duration_s, rng)
        rows = rng.integers(0, len(lengths), arrival_s.size)
        return cls.of(arrival_s, lengths.prompt_tokens[rows], lengths.output_tokens[rows], tpot_s)

    @property
    def end_s(self) -> np.ndarray:
        return self.arrival_s + self.decode_tokens * self.tpot_s

    def live_bytes(self, t: float, alive: np.ndarray) -> float:
        """Real KV bytes held at time t by requests not dropped."""
        live = alive & (self.arrival_s <= t) & (self.end_s > t)
        decoded = np.clip(np.floor((t - self.arrival_s[live]) / self.tpot_s + _TICK_EPS), 0,
                          self.decode_tokens[live])
        tokens = self.prefill_tokens[live] + decoded
        return float(tokens @ self.token_bytes[self.model[live]])

    def kv_byte_seconds(self) -> np.ndarray:
        """Per request, the integral of its live bytes over its life (exact for live_bytes)."""
        p, d = self.prefill_tokens, self.decode_tokens
        return self.token_bytes[self.model] * self.tpot_s * (d * p + d * (d - 1) / 2)

    def mean_demand_bytes(self) -> np.ndarray:
        """Per model, live bytes averaged over [0, last end] with no memory limit."""
        horizon_s = float(self.end_s.max())
        return np.bincount(self.model, weights=self.kv_byte_seconds(),
                           minlength=self.token_bytes.size) / horizon_s


def matched_rate_per_s(target_mean_bytes: float, prompt: np.ndarray, output: np.ndarray,
                       token_bytes: np.ndarray, tpot_s: float) -> float:
    """The Poisson rate whose mean live KV (Little's law) is `target_mean_bytes`."""
    p, d = prompt.astype(np.float64), output.astype(np.float64)
    per_request = tpot_s * float(np.mean(d * p + d * (d - 1) / 2)) * float(token_bytes.mean())
    return target_mean_bytes / per_request


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
    """Variable-size blocks, first fit in address order over a sorted list of holes.

    aligned: a block of size s starts at a multiple of s (flat slot indexing, see the module
    docstring); the bytes skipped to reach it stay a hole.
    """

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


def fixed_block_tokens(shape: KVShape, block_bytes: int, min_page: int,
                       alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int | None:
    """Tokens a shared `block_bytes` block holds for `shape` when SGLang indexes it flat.

    Block b must be page b of the model's view (slot s at s x stride), so block_bytes = page x
    stride exactly, with stride >= token_bytes and stride % alignment == 0; the largest page
    comes from the smallest such stride. The rest, block_bytes - page x token_bytes, is lost in
    every block. None when no stride gives at least `min_page` tokens.
    """
    if block_bytes % alignment_bytes:
        return None
    units = block_bytes // alignment_bytes
    low, high = -(-shape.token_bytes // alignment_bytes), units // min_page
    if high < low:
        return None
    strides = np.arange(low, high + 1, dtype=np.int64)
    fitting = strides[units % strides == 0]
    return int(units // fitting[0]) if fitting.size else None


@dataclass(frozen=True)
class FixedBlockPlan:
    """One block size for every model, and the tokens each model puts in a block."""

    block_bytes: int
    tokens_per_block: tuple[int, ...]
    token_bytes: tuple[int, ...]

    @property
    def remainder_waste(self) -> tuple[float, ...]:
        """Per model, the fraction of each block that no token uses."""
        return tuple(1 - p * t / self.block_bytes
                     for p, t in zip(self.tokens_per_block, self.token_bytes, strict=True))

    @classmethod
    def fit(cls, shapes: tuple[KVShape, ...], block_bytes: int, min_page: int
            ) -> FixedBlockPlan | None:
        pages = [fixed_block_tokens(s, block_bytes, min_page) for s in shapes]
        if any(p is None for p in pages):
            return None
        return cls(block_bytes, tuple(p for p in pages if p is not None),
                   tuple(s.token_bytes for s in shapes))


def fixed_block_plans(shapes: tuple[KVShape, ...], min_page: int, max_waste: float
                      ) -> dict[str, FixedBlockPlan]:
    """`largest`: B = min_page x the largest token stride; `lowpad`: the smallest 7-smooth B
    above it whose worst remainder waste is within `max_waste` (searched up to 16x)."""
    align = DEFAULT_ALIGNMENT_BYTES
    largest_bytes = min_page * max(-(-s.token_bytes // align) * align for s in shapes)
    largest = FixedBlockPlan.fit(shapes, largest_bytes, min_page)
    if largest is None:
        raise ConfigError(f"internal: {largest_bytes} B does not fit every model")
    plans = {"largest": largest}
    for block_bytes in smooth_numbers(largest_bytes, 16 * largest_bytes):
        plan = FixedBlockPlan.fit(shapes, block_bytes, min_page)
        if plan is not None and max(plan.remainder_waste) <= max_waste:
            plans["lowpad"] = plan
            break
    return plans


@dataclass(frozen=True)
class Outcome:
    first_failure_util: float | None  # first fragmentation refusal
    first_failure_s: float | None
    first_failure_asked: float | None  # the refused tokens' bytes / arena bytes
    failure_utils: tuple[float, ...]  # every fragmentation refusal
    first_refusal_util: float | None  # first refusal of either kind
    num_capacity_refusals: int
    time_avg_util: float
    num_dropped: int

    @property
    def mean_failure_util(self) -> float | None:
        return float(np.mean(self.failure_utils)) if self.failure_utils else None


def replay(work: Workload, events: tuple[np.ndarray, ...], scheme: Scheme,
           arena_bytes: int) -> Outcome:
    """Run the events through `scheme`, dropping a request whose allocation fails."""
    alive = np.ones(work.arrival_s.size, dtype=bool)
    held: dict[int, list[object]] = {}
    samples = np.linspace(0.0, float(work.end_s.max()), NUM_SAMPLES)
    sampled: list[float] = []
    failures: list[tuple[float, float, float]] = []
    refusals: list[float] = []
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
            # live_bytes(t) already counts the tokens asked for: the prompt, or the one decode
            # token that opened a new block
            asked = work.prefill_tokens[request] if request not in held else 1
            live_with_asked = work.live_bytes(t, alive)
            asked_bytes = float(asked * work.token_bytes[model])
            util = (live_with_asked - asked_bytes) / arena_bytes
            refusals.append(util)
            if live_with_asked <= arena_bytes:
                failures.append((t, util, asked_bytes / arena_bytes))
            alive[request] = False
            scheme.free(model, held.pop(request, []))
            continue
        held.setdefault(request, []).append(handle)
    first = failures[0] if failures else None
    return Outcome(first[1] if first else None, first[0] if first else None,
                   first[2] if first else None, tuple(f[1] for f in failures),
                   refusals[0] if refusals else None, len(refusals) - len(failures),
                   float(np.mean(sampled)) / arena_bytes, int((~alive).sum()))


def build_schemes(work: Workload, arena_bytes: int, folder: Path, page_sizes: tuple[int, ...]
                  ) -> tuple[dict[str, tuple[Scheme, np.ndarray]], list[BlockFormat], int,
                             dict[str, FixedBlockPlan]]:
    """Each scheme with the tokens-per-block of each model it uses; the slab and fixed plans."""
    plan = plan_slabs(MODELS, page_sizes=page_sizes)
    formats = list(plan.formats)
    tpb = np.array([f.tokens_per_block for f in formats], dtype=np.int64)
    block_bytes = [f.block_bytes for f in formats]  # unpadded: own pools, no slab to divide
    share = work.mean_demand_bytes()
    share /= share.sum()
    static_caps = [int(arena_bytes * share[m] // block_bytes[m]) for m in range(len(MODELS))]
    schemes: dict[str, tuple[Scheme, np.ndarray]] = {
        "slab": (SlabScheme(arena_bytes, plan.slab_bytes, formats, folder), tpb),
        "static": (CountingScheme(static_caps, list(range(len(MODELS)))), tpb),
    }
    fixed = fixed_block_plans(MODELS, min(page_sizes), plan.max_padding_waste)
    for name, fixed_plan in fixed.items():
        schemes[f"fixed_block_{name}"] = (
            CountingScheme([arena_bytes // fixed_plan.block_bytes], [0] * len(MODELS)),
            np.array(fixed_plan.tokens_per_block, dtype=np.int64))
    schemes["first_fit"] = (FirstFitScheme(arena_bytes, block_bytes, aligned=True), tpb)
    schemes["first_fit_unaligned"] = (FirstFitScheme(arena_bytes, block_bytes, aligned=False),
                                      tpb)
    return schemes, formats, plan.slab_bytes, fixed


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


def _better_fixed(result: dict[str, object], names: list[str]) -> str:
    """The fixed-block variant with the higher first-failure utilization (None counts as 1)."""
    def score(name: str) -> tuple[float, float]:
        first = result[name]
        return (1.0 if first is None else float(first),  # type: ignore[arg-type]
                float(result[f"{name}_time_avg"]))  # type: ignore[arg-type]
    return max(names, key=score)


def load_workload(args: argparse.Namespace) -> tuple[Workload, str]:
    if args.workload == "azure":
        trace = args.trace or AZURE_CONV
        return Workload.azure(trace, args.tpot_s), f"{trace.name}"
    trace = args.trace or SHAREGPT_STATS
    rate = args.rate_per_s
    if rate is None:
        azure = Workload.azure(AZURE_CONV, args.tpot_s)
        lengths = load_lengths(trace, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
        rate = matched_rate_per_s(float(azure.mean_demand_bytes().sum()), lengths.prompt_tokens,
                                  lengths.output_tokens, azure.token_bytes, args.tpot_s)
    work = Workload.sharegpt(trace, args.tpot_s, rate, args.duration_s, args.seed)
    return work, f"{trace.name}, Poisson {rate:.3f}/s, seed {args.seed}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, default=None,
                        help="trace CSV (default: the shared trace of --workload)")
    parser.add_argument("--workload", choices=("azure", "sharegpt"), default="azure")
    parser.add_argument("--arena-gib", type=float, default=8.0)
    parser.add_argument("--tpot-s", type=float, default=0.05, help="seconds per decode token")
    parser.add_argument("--page-sizes", default="16,32,64",
                        help="allowed tokens per block (smaller pages give smaller slabs)")
    parser.add_argument("--rate-per-s", type=float, default=None,
                        help="sharegpt: arrival rate (default: azure's mean KV demand)")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="sharegpt: duration")
    parser.add_argument("--seed", type=int, default=0, help="sharegpt: arrivals and rows")
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work, label = load_workload(args)
    arena_bytes = int(args.arena_gib * GIB)
    result: dict[str, object] = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        page_sizes = tuple(int(p) for p in args.page_sizes.split(","))
        schemes, formats, slab_bytes, fixed = build_schemes(work, arena_bytes, Path(folder),
                                                            page_sizes)
        for name, (scheme, tpb) in schemes.items():
            out = replay(work, block_events(work, tpb), scheme, arena_bytes)
            if isinstance(scheme, SlabScheme):
                scheme.close()
            result.update({name: _rounded(out.first_failure_util),
                           f"{name}_at_failures": _rounded(out.mean_failure_util),
                           f"{name}_time_avg": round(out.time_avg_util, 4),
                           f"{name}_first_refusal": _rounded(out.first_refusal_util),
                           f"{name}_first_failure_s": _rounded(out.first_failure_s),
                           f"{name}_first_failure_asked": _rounded(out.first_failure_asked),
                           f"{name}_fragmentation_refusals": len(out.failure_utils),
                           f"{name}_capacity_refusals": out.num_capacity_refusals,
                           f"{name}_dropped": out.num_dropped})
            rows.append([name, *(v if v is not None else "-" for v in (
                out.first_failure_util, out.mean_failure_util)), out.time_avg_util,
                len(out.failure_utils), out.num_capacity_refusals, out.num_dropped,
                out.first_failure_s if out.first_failure_s is not None else "-"])
    best = _better_fixed(result, [f"fixed_block_{n}" for n in fixed])
    for suffix in ("", "_at_failures", "_time_avg", "_first_refusal", "_first_failure_s",
                   "_first_failure_asked", "_dropped"):
        result[f"fixed_block{suffix}"] = result[f"{best}{suffix}"]
    result.update(
        workload=args.workload, trace=label, slab_bytes=slab_bytes, arena_bytes=arena_bytes,
        tpot_s=args.tpot_s, requests=int(work.arrival_s.size), fixed_block_variant=best,
        fixed_block_bytes={n: p.block_bytes for n, p in fixed.items()},
        mean_demand_bytes=round(float(work.mean_demand_bytes().sum())),
        padding_waste={f.name: round(f.padding_waste, 5) for f in formats})
    plan_rows = [[f.name, f.token_bytes, f.token_stride_bytes, f.tokens_per_block,
                  f.padding_waste, *(v for p in fixed.values()
                                     for v in (p.tokens_per_block[i], p.remainder_waste[i]))]
                 for i, f in enumerate(formats)]
    fixed_headers = [h for n, p in fixed.items() for h in (
        f"{n} {p.block_bytes / (1 << 20):.3g} MiB tok/blk", "remainder")]
    emit(f"Slab plan: slab {slab_bytes / (1 << 20):.2f} MiB, arena {args.arena_gib} GiB; "
         f"fixed-block plans", ["model", "token B", "stride B", "tokens/block", "padding",
                                *fixed_headers], plan_rows, {}, False)
    emit(f"Live KV / arena, {work.arrival_s.size} requests ({label}), tpot {args.tpot_s}s, "
         f"mean demand {work.mean_demand_bytes().sum() / GIB:.2f} GiB; fixed_block = {best}",
         ["scheme", "1st frag. refusal", "mean at frag.", "time avg", "frag. refusals",
          "cap. refusals", "dropped", "1st frag. s"], rows, result, args.json)


if __name__ == "__main__":
    main()

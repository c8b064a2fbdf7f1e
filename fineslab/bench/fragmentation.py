"""Benchmark: how much of a fixed arena holds live KV when four mixed-precision models share it.

    python -m fineslab.bench.fragmentation [--workload azure|sharegpt] [TRACE] [--json]
                                           [--arena-gib 8] [--tpot-s 0.05] [--page-sizes 16-64]

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

Schemes (`fineslab.bench.fragmentation_schemes`, where each one and the rules it must honor
under SGLang are described): slab (fineslab itself: key pools over the plan of
`plan_shared_slabs`), slab_private (slabs of its own per model, the plan of `plan_slabs`),
static (a private pool per model, sized
here from this run's exact mean KV demand: an oracle), fixed_block (one shared pool of uniform
blocks; two block sizes, `fixed_block_largest` and `fixed_block_lowpad`, the better is the key),
first_fit (variable-size aligned blocks in one byte range; `first_fit_unaligned` for scale).

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

import numpy as np

from fineslab.bench.fragmentation_schemes import (
    CountingScheme,
    FirstFitScheme,
    FixedBlockPlan,
    Scheme,
    SlabScheme,
    fixed_block_plans,
)
from fineslab.bench.report import add_json_flag, emit
from fineslab.slabs.formats import KVDtype, KVShape
from fineslab.slabs.key_sharing import WasteModel, plan_shared_slabs
from fineslab.slabs.sizing import SlabPlan, plan_slabs
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
                  ) -> tuple[dict[str, tuple[Scheme, np.ndarray]], SlabPlan, SlabPlan,
                             dict[str, FixedBlockPlan]]:
    """Each scheme with the tokens-per-block of each model it uses; the slab plans (key pools,
    private) and the fixed-block plans."""
    plan = plan_shared_slabs(MODELS, page_sizes=page_sizes,
                             waste=WasteModel(model_kv_bytes=arena_bytes / len(MODELS)))
    private = plan_slabs(MODELS, page_sizes=page_sizes)
    formats = list(plan.formats)
    tpb = np.array([f.tokens_per_block for f in formats], dtype=np.int64)
    block_bytes = [f.block_bytes for f in formats]  # unpadded: own pools, no slab to divide
    share = work.mean_demand_bytes()
    share /= share.sum()
    static_caps = [int(arena_bytes * share[m] // block_bytes[m]) for m in range(len(MODELS))]
    schemes: dict[str, tuple[Scheme, np.ndarray]] = {
        "slab": (SlabScheme(arena_bytes, plan.slab_bytes, formats, folder), tpb),
        "slab_private": (SlabScheme(arena_bytes, private.slab_bytes, list(private.formats),
                                    folder, key_pools=False),
                         np.array([f.tokens_per_block for f in private.formats], np.int64)),
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
    return schemes, plan, private, fixed


def parse_page_sizes(text: str) -> tuple[int, ...]:
    """"16,32,64" or a range "16-64" (both ends included)."""
    if "-" in text:
        low, high = (int(v) for v in text.split("-", 1))
        return tuple(range(low, high + 1))
    return tuple(int(p) for p in text.split(","))


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
    parser.add_argument("--page-sizes", default="16-64",
                        help="allowed tokens per block, a list or a range (default 16-64)")
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
        page_sizes = parse_page_sizes(args.page_sizes)
        schemes, plan, private, fixed = build_schemes(work, arena_bytes, Path(folder),
                                                      page_sizes)
        formats, slab_bytes = list(plan.formats), plan.slab_bytes
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
        padding_waste={f.name: round(f.padding_waste, 5) for f in formats},
        slab_private_bytes=private.slab_bytes,
        slab_tokens_per_block={f.name: f.tokens_per_block for f in formats},
        slab_key_pools=[[f.name for f in formats if f.block_stride_bytes == key]
                        for key in sorted({f.block_stride_bytes for f in formats})])
    plan_rows = [[f.name, f.token_bytes, f.token_stride_bytes, f.tokens_per_block,
                  f.padding_waste, f"{f.block_stride_bytes / (1 << 20):.3g}",
                  private.formats[i].tokens_per_block, *(v for p in fixed.values()
                                     for v in (p.tokens_per_block[i], p.remainder_waste[i]))]
                 for i, f in enumerate(formats)]
    fixed_headers = [h for n, p in fixed.items() for h in (
        f"{n} {p.block_bytes / (1 << 20):.3g} MiB tok/blk", "remainder")]
    emit(f"Slab plan (key pools): slab {slab_bytes / (1 << 20):.3g} MiB; slab_private "
         f"{private.slab_bytes / (1 << 20):.3g} MiB; arena {args.arena_gib} GiB; fixed-block "
         f"plans", ["model", "token B", "stride B", "tokens/block", "padding", "block MiB",
                    "private tok/blk", *fixed_headers], plan_rows, {}, False)
    emit(f"Live KV / arena, {work.arrival_s.size} requests ({label}), tpot {args.tpot_s}s, "
         f"mean demand {work.mean_demand_bytes().sum() / GIB:.2f} GiB; fixed_block = {best}",
         ["scheme", "1st frag. refusal", "mean at frag.", "time avg", "frag. refusals",
          "cap. refusals", "dropped", "1st frag. s"], rows, result, args.json)


if __name__ == "__main__":
    main()

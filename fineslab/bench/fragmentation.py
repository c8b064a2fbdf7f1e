"""Benchmark: how much of an arena holds live KV when four mixed-precision models share it.

    python -m fineslab.bench.fragmentation [--workload azure|sharegpt] [TRACE] [--json]
        [--protocol both|critical|fixed] [--arena-gib 8] [--tolerance 2e-4]
        [--tpot-s 0.05] [--page-sizes 16-64] [--schemes slab,static,...]

Workloads (both dealt round-robin to the four models of MODELS: Llama-3-8B BF16 KV, Llama-3-8B
FP8 KV, Qwen2.5-7B INT4 KV (QoQ KV4), a TP=2 shard of Llama-3-70B BF16 KV):

  azure      the rows of splitwise_conv.csv (arrival, prompt, output), prompts clipped to 8,192
  sharegpt   the ShareGPT length table (the simulator's: prompt <= 8192, output <= 1024), rows
             drawn with replacement, Poisson arrivals over --duration-s; the rate, unless given,
             is matched so the unconstrained mean KV demand equals the azure workload's

A request takes its prompt's blocks at arrival (one batch), then one token every --tpot-s
seconds (a new block when a block fills), and frees everything when its last token is out. A
refused allocation drops its request (its blocks freed). Schemes and the rules each honors:
`fineslab.bench.fragmentation_schemes`; replay, refusals and the critical arena:
`fineslab.bench.fragmentation_replay`. Utilization = live KV bytes / arena bytes.

Protocols (both by default):
  critical  each scheme at its own limit: the smallest arena in which it serves the whole trace
            (bisection to --tolerance x the peak live bytes). Keys `slab`, `static`,
            `fixed_block`, `first_fit`: the utilization at the first failure in the largest
            arena that fails (just below the critical one); `<scheme>_arena_bytes` the critical
            arena, `<scheme>_peak_share` the peak live bytes over it, `<scheme>_time_avg` the
            mean live bytes over it. `first_fit_unaligned` (not servable) is left out here.
  fixed     every scheme in one --arena-gib arena: under `fixed_arena`, `<scheme>` the
            utilization at its first fragmentation refusal (a capacity refusal, which no
            allocator could serve, is counted apart), `_at_failures` the mean over them,
            `_time_avg` the run average (2,000 instants), drops and refusal counts.
fixed_block and first_fit are the better of their variants (critical: the smaller arena; fixed:
the higher first failure, then time average): `fixed_block_variant`, `first_fit_variant`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fineslab.bench.fragmentation_replay import (
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    CriticalArena,
    Outcome,
    Workload,
    block_events,
    critical_arena,
    matched_rate_per_s,
    replay,
)
from fineslab.bench.fragmentation_schemes import SchemeSet
from fineslab.slabs.formats import KVDtype, KVShape
from fineslab.tables import add_json_flag, emit
from fineslab.workload import AZURE_CONV, SHAREGPT_STATS, load_lengths

logger = logging.getLogger(__name__)

GIB = 1 << 30
MODELS = (
    KVShape("llama3-8b-bf16", 32, 8, 128, KVDtype.BF16),
    KVShape("llama3-8b-fp8kv", 32, 8, 128, KVDtype.FP8_E4M3),
    KVShape("qwen2.5-7b-int4kv", 28, 4, 128, KVDtype.INT4),
    KVShape("llama3-70b-tp2-bf16", 80, 8, 128, KVDtype.BF16, tp_size=2),
)
ISSUE_KEYS = ("slab", "static", "fixed_block", "first_fit")
NOT_IN_CRITICAL = ("first_fit_unaligned",)
FIRST_FIT_VARIANTS = ("first_fit_plan_pages", "first_fit_min_page")


def run_critical(work: Workload, schemes: SchemeSet, names: list[str], peak_bytes: float,
                 tolerance: float, folder: Path) -> dict[str, CriticalArena]:
    found = {}
    for name in names:
        start = time.monotonic()
        events = block_events(work, schemes.tokens_per_block(name))
        found[name] = critical_arena(work, events, functools.partial(
            schemes.build, name, folder=folder), peak_bytes, tolerance)
        logger.info("critical: %-20s %.4f GiB (%d probes, %.0f s)", name,
                    found[name].arena_bytes / GIB, found[name].num_probes,
                    time.monotonic() - start)
    return found


def run_fixed(work: Workload, schemes: SchemeSet, names: list[str], arena_bytes: int,
              folder: Path) -> dict[str, Outcome]:
    found = {}
    for name in names:
        start = time.monotonic()
        scheme = schemes.build(name, arena_bytes, folder)
        try:
            found[name] = replay(work, block_events(work, schemes.tokens_per_block(name)),
                                 scheme, arena_bytes)
        finally:
            scheme.close()
        logger.info("fixed %.3g GiB: %-20s (%.0f s)", arena_bytes / GIB, name,
                    time.monotonic() - start)
    return found


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return round(value, digits) if value is not None else None


def _variants_of(key: str, names: list[str]) -> list[str]:
    """The schemes whose best stands for the issue's key `key` (fixed_block, first_fit)."""
    if key == "fixed_block":
        return [n for n in names if n.startswith("fixed_block_")]
    return [n for n in names if n in FIRST_FIT_VARIANTS]


def _flatten(per_scheme: dict[str, dict[str, object]],
             score: Callable[[str], tuple[float, ...]]) -> dict[str, object]:
    """`{scheme: {suffix: value}}` as `<scheme><suffix>` keys, and each baseline's best variant
    (by `score`) again under the issue's key, with `<key>_variant` naming it."""
    rows = dict(per_scheme)
    result: dict[str, object] = {}
    for key in ("fixed_block", "first_fit"):
        variants = _variants_of(key, list(per_scheme))
        if variants:
            best = max(variants, key=score)
            rows[key] = per_scheme[best]
            result[f"{key}_variant"] = best
    for name, values in rows.items():
        result.update({f"{name}{suffix}": value for suffix, value in values.items()})
    return result


def critical_result(found: dict[str, CriticalArena], peak_bytes: float,
                    mean_bytes: float) -> dict[str, object]:
    per_scheme: dict[str, dict[str, object]] = {name: {
        "": _rounded(crit.first_failure.first_failure_util),
        "_arena_bytes": crit.arena_bytes,
        "_failing_arena_bytes": crit.failing_arena_bytes,
        "_peak_share": round(peak_bytes / crit.arena_bytes, 4),
        "_time_avg": round(mean_bytes / crit.arena_bytes, 4),
        "_first_failure_s": _rounded(crit.first_failure.first_failure_s),
        "_probes": crit.num_probes} for name, crit in found.items()}

    def score(name: str) -> tuple[float, ...]:
        # the variant that needs less memory is the better allocator, whatever the utilization
        # at its first failure (which can be higher for a variant needing a bigger arena)
        first = found[name].first_failure.first_failure_util
        return (-found[name].arena_bytes, first if first is not None else 1.0)
    return _flatten(per_scheme, score)


def fixed_result(found: dict[str, Outcome], arena_bytes: int) -> dict[str, object]:
    per_scheme: dict[str, dict[str, object]] = {name: {
        "": _rounded(out.first_failure_util),
        "_at_failures": _rounded(out.mean_failure_util),
        "_time_avg": _rounded(out.time_avg_util),
        "_first_refusal": _rounded(out.first_refusal_util),
        "_first_failure_s": _rounded(out.first_failure_s),
        "_first_failure_asked": _rounded(out.first_failure_asked),
        "_fragmentation_refusals": len(out.failure_utils),
        "_capacity_refusals": out.num_capacity_refusals,
        "_dropped": out.num_dropped} for name, out in found.items()}

    def score(name: str) -> tuple[float, ...]:
        first, avg = found[name].first_failure_util, found[name].time_avg_util
        return (1.0 if first is None else first, avg or 0.0)
    return {"arena_bytes": arena_bytes, **_flatten(per_scheme, score)}


def parse_page_sizes(text: str) -> tuple[int, ...]:
    """"16,32,64" or a range "16-64" (both ends included)."""
    if "-" in text:
        low, high = (int(v) for v in text.split("-", 1))
        return tuple(range(low, high + 1))
    return tuple(int(p) for p in text.split(","))


def load_workload(args: argparse.Namespace) -> tuple[Workload, str]:
    if args.workload == "azure":
        trace = args.trace or AZURE_CONV
        return Workload.azure(trace, args.tpot_s, MODELS), f"{trace.name}"
    trace = args.trace or SHAREGPT_STATS
    rate = args.rate_per_s
    if rate is None:
        azure = Workload.azure(AZURE_CONV, args.tpot_s, MODELS)
        lengths = load_lengths(trace, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS)
        rate = matched_rate_per_s(float(azure.mean_demand_bytes().sum()), lengths.prompt_tokens,
                                  lengths.output_tokens, azure.token_bytes, args.tpot_s)
    work = Workload.sharegpt(trace, args.tpot_s, rate, args.duration_s, args.seed, MODELS)
    return work, f"{trace.name}, Poisson {rate:.3f}/s, seed {args.seed}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.fragmentation",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, default=None,
                        help="trace CSV (default: the shared trace of --workload)")
    parser.add_argument("--workload", choices=("azure", "sharegpt"), default="azure")
    parser.add_argument("--protocol", choices=("both", "critical", "fixed"), default="both")
    parser.add_argument("--arena-gib", type=float, default=8.0,
                        help="the fixed protocol's arena (default 8)")
    parser.add_argument("--tolerance", type=float, default=2e-4,
                        help="critical protocol: bisection step, a fraction of the peak")
    parser.add_argument("--tpot-s", type=float, default=0.05, help="seconds per decode token")
    parser.add_argument("--page-sizes", default="16-64",
                        help="allowed tokens per block, a list or a range (default 16-64)")
    parser.add_argument("--schemes", default=None,
                        help="comma-separated scheme names (default: all)")
    parser.add_argument("--rate-per-s", type=float, default=None,
                        help="sharegpt: arrival rate (default: azure's mean KV demand)")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="sharegpt: duration")
    parser.add_argument("--seed", type=int, default=0, help="sharegpt: arrivals and rows")
    add_json_flag(parser)
    return parser.parse_args(argv)


def _plan_rows(schemes: SchemeSet) -> tuple[list[str], list[list[object]]]:
    fixed_headers = [h for n, p in schemes.fixed.items() for h in (
        f"{n} {p.block_bytes / (1 << 20):.3g} MiB tok/blk", "remainder")]
    headers = ["model", "token B", "stride B", "tokens/block", "padding", "block MiB",
               "private tok/blk", *fixed_headers]
    rows: list[list[object]] = [
        [f.name, f.token_bytes, f.token_stride_bytes, f.tokens_per_block, f.padding_waste,
         f"{f.block_stride_bytes / (1 << 20):.3g}", schemes.private.formats[i].tokens_per_block,
         *(v for p in schemes.fixed.values()
           for v in (p.tokens_per_block[i], p.remainder_waste[i]))]
        for i, f in enumerate(schemes.shared.formats)]
    return headers, rows


def _critical_rows(found: dict[str, CriticalArena], peak_bytes: float) -> list[list[object]]:
    return [[name, crit.arena_bytes / GIB, peak_bytes / crit.arena_bytes,
             crit.first_failure.first_failure_util or "-",
             crit.first_failure.first_failure_s or "-", crit.num_probes]
            for name, crit in found.items()]


def _fixed_rows(found: dict[str, Outcome]) -> list[list[object]]:
    return [[name, *(v if v is not None else "-" for v in (
        out.first_failure_util, out.mean_failure_util, out.time_avg_util)),
        len(out.failure_utils), out.num_capacity_refusals, out.num_dropped,
        out.first_failure_s if out.first_failure_s is not None else "-"]
        for name, out in found.items()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[fragmentation] %(message)s",
                        stream=sys.stderr)
    work, label = load_workload(args)
    arena_bytes = int(args.arena_gib * GIB)
    page_sizes = parse_page_sizes(args.page_sizes)
    peak_bytes, peak_s = work.peak_live()
    demand = work.mean_demand_bytes()
    schemes = SchemeSet.plan(MODELS, page_sizes, demand, model_kv_bytes=peak_bytes / len(MODELS))
    names = args.schemes.split(",") if args.schemes else list(schemes.names)
    unknown = sorted(set(names) - set(schemes.names))
    if unknown:
        sys.exit(f"fragmentation: unknown scheme(s) {', '.join(unknown)}; known: "
                 f"{', '.join(schemes.names)}")
    mean_bytes = float(demand.sum())
    plan = schemes.shared
    result: dict[str, object] = dict(
        workload=args.workload, trace=label, requests=int(work.arrival_s.size),
        tpot_s=args.tpot_s, page_sizes=args.page_sizes, tolerance=args.tolerance,
        peak_live_bytes=round(peak_bytes), peak_live_s=round(peak_s, 3),
        mean_demand_bytes=round(mean_bytes), slab_bytes=plan.slab_bytes,
        slab_private_bytes=schemes.private.slab_bytes,
        slab_tokens_per_block={f.name: f.tokens_per_block for f in plan.formats},
        padding_waste={f.name: round(f.padding_waste, 5) for f in plan.formats},
        slab_key_pools=[[f.name for f in plan.formats if f.block_stride_bytes == key]
                        for key in sorted({f.block_stride_bytes for f in plan.formats})],
        fixed_block_bytes={n: p.block_bytes for n, p in schemes.fixed.items()})
    headers, rows = _plan_rows(schemes)
    emit(f"Slab plan (key pools): slab {plan.slab_bytes / (1 << 20):.3g} MiB; slab_private "
         f"{schemes.private.slab_bytes / (1 << 20):.3g} MiB; fixed-block plans", headers, rows,
         {}, False)
    title = (f"{work.arrival_s.size} requests ({label}), tpot {args.tpot_s}s, peak live KV "
             f"{peak_bytes / GIB:.3f} GiB at {peak_s:.0f} s, mean {mean_bytes / GIB:.2f} GiB")
    with tempfile.TemporaryDirectory() as folder:
        if args.protocol in ("both", "critical"):
            found = run_critical(work, schemes, [n for n in names if n not in NOT_IN_CRITICAL],
                                 peak_bytes, args.tolerance, Path(folder))
            result.update(critical_result(found, peak_bytes, mean_bytes))
            emit(f"Critical arena (the smallest that serves the whole trace), {title}",
                 ["scheme", "arena GiB", "peak live / arena", "1st failure util",
                  "1st failure s", "probes"], _critical_rows(found, peak_bytes), {}, False)
        if args.protocol in ("both", "fixed"):
            outcomes = run_fixed(work, schemes, names, arena_bytes, Path(folder))
            result["fixed_arena"] = fixed_result(outcomes, arena_bytes)
            emit(f"Fixed {args.arena_gib:g} GiB arena, {title}",
                 ["scheme", "1st frag. refusal", "mean at frag.", "time avg", "frag. refusals",
                  "cap. refusals", "dropped", "1st frag. s"], _fixed_rows(outcomes), {}, False)
    keys = [[k, result[k], result.get(f"{k}_variant", k)] for k in ISSUE_KEYS if k in result]
    emit("The issue's keys (utilization at the first failure, critical protocol)",
         ["key", "value", "variant"], keys, result, args.json)


if __name__ == "__main__":
    main()

"""Load generator: `python -m fineslab.bench.serve --url URL [--model-mix a:1,b:0.5] ...`.

Drives any OpenAI-compatible endpoint (the fineslab router, or SGLang directly) with streamed
completions: Poisson arrivals at the mix's rates times `--rate-scale`, or an Azure-format trace
replayed on a scaled clock (`--arrival replay --trace PATH`); lengths from a trace; prompts
built to the target length, `max_tokens` = the sampled output length, `ignore_eos` on. Reports
what `sglang.bench_serving` and `vllm bench serve` do (TTFT, TPOT, ITL, E2E: mean/p50/p95/p99;
request and output-token throughput), plus TTFT SLO attainment per model and goodput; writes
`results.json` and PNG plots into `--out`. The sending and measuring is `fineslab.loadgen`
(the profiler and the simulator's fidelity check use it too).

    python -m fineslab.bench.serve --url http://127.0.0.1:30000 --rate 2 --duration 30 \
        --slo 1.0 --out results/serve --json
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fineslab.loadgen.client import ClientConfig
from fineslab.loadgen.run import (
    SUMMARY_HEADERS,
    BenchConfig,
    discover_model,
    result_json,
    run_benchmark,
    summary_rows,
    write_results,
)
from fineslab.tables import add_json_flag, emit
from fineslab.workload import (
    ARRIVAL_KINDS,
    SHAREGPT_STATS,
    ModelLoad,
    Request,
    WorkloadSpec,
    build_workload,
    parse_mix,
)

logger = logging.getLogger(__name__)


# -- CLI ----------------------------------------------------------------------------------------
def parse_slo(text: str | None, models: Sequence[str]) -> dict[str, float]:
    """`"1.5"` (every model) or `"a:1.5,b:0.8"`."""
    if not text:
        return {}
    if ":" not in text:
        return dict.fromkeys(models, float(text))
    return {m.model: m.rate_per_s for m in parse_mix(text)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fineslab.bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="base URL of an OpenAI-compatible server")
    p.add_argument("--model-mix", default=None,
                   help="name:rate,... (req/s at rate scale 1); default: the server's model "
                        "at --rate")
    p.add_argument("--rate", type=float, default=1.0, help="req/s when no --model-mix")
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--arrival", choices=ARRIVAL_KINDS, default="poisson")
    p.add_argument("--trace", default=str(SHAREGPT_STATS),
                   help="lengths CSV (poisson) or Azure-format arrival trace (replay)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="replay: trace time / this (default: match the mix's total rate)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--num-requests", type=int, default=None, help="send only the first N")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-output-tokens", type=int, default=1024)
    p.add_argument("--slo", default=None, help="TTFT SLO in s: one value or name:s,...")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or model folder")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for results.json and plots")
    p.add_argument("--no-progress", action="store_true")
    add_json_flag(p)
    return p


def requests_from_args(args: argparse.Namespace, mix: tuple[ModelLoad, ...]) -> list[Request]:
    spec = WorkloadSpec(mix, args.duration, Path(args.trace), arrival=args.arrival,
                        rate_scale=args.rate_scale, time_scale=args.time_scale,
                        max_prompt_tokens=args.max_prompt_tokens,
                        max_output_tokens=args.max_output_tokens, seed=args.seed)
    requests = build_workload(spec)
    return requests[: args.num_requests] if args.num_requests else requests


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = build_parser().parse_args(argv)
    mix = (parse_mix(args.model_mix) if args.model_mix
           else (ModelLoad(discover_model(args.url), args.rate),))
    requests = requests_from_args(args, mix)
    cfg = BenchConfig(ClientConfig(args.url, ignore_eos=not args.no_ignore_eos,
                                   timeout_s=args.timeout),
                      slo_s=parse_slo(args.slo, [m.model for m in mix]),
                      tokenizer=Path(args.tokenizer) if args.tokenizer else None,
                      max_concurrency=args.max_concurrency, progress=not args.no_progress,
                      seed=args.seed)
    result = run_benchmark(cfg, requests)
    if args.out:
        for path in write_results(result, Path(args.out)):
            logger.info("wrote %s", path)
    emit(f"load generator: {len(requests)} requests to {args.url} in {result.wall_s:.1f} s",
         SUMMARY_HEADERS, summary_rows(result), result_json(result), args.json)
    return 0 if result.summary().num_completed else 1


if __name__ == "__main__":
    sys.exit(main())

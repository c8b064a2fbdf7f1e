"""Load generator: `python -m fineslab.bench.serve --url URL [--model-mix a:1,b:0.5] ...`.

Drives any OpenAI-compatible endpoint (the fineslab router, or SGLang directly) with streamed
completions: Poisson arrivals at the mix's rates times `--rate-scale`, or an Azure-format trace
replayed on a scaled clock (`--arrival replay --trace PATH`); lengths from a trace; prompts
built to the target length (`loadgen_prompts`), `max_tokens` = the sampled output length,
`ignore_eos` on. Reports what `sglang.bench_serving` and `vllm bench serve` do (TTFT, TPOT,
ITL, E2E: mean/p50/p95/p99; request and output-token throughput), plus TTFT SLO attainment
per model and goodput; writes `results.json` and PNG plots into `--out`.

    python -m fineslab.bench.serve --url http://127.0.0.1:30000 --rate 2 --duration 30 \
        --slo 1.0 --out results/serve --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from fineslab.bench.loadgen_client import ClientConfig, send_request
from fineslab.bench.loadgen_metrics import (
    RequestOutcome,
    Summary,
    summarize,
    summarize_by_model,
)
from fineslab.bench.loadgen_prompts import PromptBuilder
from fineslab.bench.report import add_json_flag, emit
from fineslab.errors import ConfigError
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


@dataclass(frozen=True)
class BenchConfig:
    client: ClientConfig
    #: TTFT SLO (s) by model; a model without one has no attainment.
    slo_s: dict[str, float] = field(default_factory=dict)
    #: The `model` field sent for each mix name (default: the name itself).
    served_names: dict[str, str] = field(default_factory=dict)
    tokenizer: Path | None = None
    max_concurrency: int | None = None
    progress: bool = True
    seed: int = 0


@dataclass(frozen=True)
class BenchResult:
    outcomes: tuple[RequestOutcome, ...]
    wall_s: float

    def summary(self) -> Summary:
        return summarize(self.outcomes)

    def by_model(self) -> dict[str, Summary]:
        return summarize_by_model(self.outcomes)


async def _run(cfg: BenchConfig, requests: Sequence[Request]) -> BenchResult:
    builder = PromptBuilder(cfg.tokenizer, seed=cfg.seed)
    prompts = [builder.prompt(r.prompt_tokens, offset=i * 7919) for i, r in enumerate(requests)]
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    bar = _progress(len(requests), cfg.progress)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start_s = time.perf_counter()

        async def one(request: Request, prompt: str) -> RequestOutcome:
            await asyncio.sleep(max(0.0, start_s + request.arrival_s - time.perf_counter()))
            async with limit:
                sent_s = time.perf_counter() - start_s
                outcome = await send_request(
                    session, cfg.client, request, cfg.served_names.get(request.model,
                                                                       request.model),
                    prompt, sent_s, cfg.slo_s.get(request.model))
            if bar is not None:
                bar.update(1)
            return outcome

        outcomes = await asyncio.gather(*(one(r, p) for r, p in
                                          zip(requests, prompts, strict=True)))
        wall_s = time.perf_counter() - start_s
    if bar is not None:
        bar.close()
    return BenchResult(tuple(outcomes), wall_s)


def _progress(total: int, enabled: bool) -> tqdm | None:
    if not enabled:
        return None
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


def run_benchmark(cfg: BenchConfig, requests: Sequence[Request]) -> BenchResult:
    """Send `requests` at their arrival times (relative to now); every one gets an outcome."""
    if not requests:
        raise ConfigError("no requests to send (duration too short or rate too low?)")
    return asyncio.run(_run(cfg, requests))


def discover_model(base_url: str) -> str:
    """The first model id `GET /v1/models` lists (an SGLang server serves one)."""
    import httpx

    try:
        data = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10.0).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"cannot list models at {base_url}: {exc}; pass --model-mix") from exc


# -- results ------------------------------------------------------------------------------------
def result_json(result: BenchResult) -> dict[str, object]:
    return {"summary": result.summary().to_dict(), "wall_s": result.wall_s,
            "by_model": {m: s.to_dict() for m, s in result.by_model().items()}}


def write_results(result: BenchResult, out_dir: Path) -> list[Path]:
    """results.json (summary, per model, per request) and two PNG plots."""
    from fineslab.bench.loadgen_plots import plot_ttft_cdf, plot_ttft_timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    data = result_json(result)
    data["requests"] = [
        {"id": o.request_id, "model": o.model, "arrival_s": o.arrival_s,
         "prompt_tokens": o.prompt_tokens, "output_tokens": o.output_tokens,
         "ttft_s": o.ttft_s, "e2e_s": o.e2e_s, "dropped": o.dropped} for o in result.outcomes]
    path = out_dir / "results.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return [path, plot_ttft_cdf(result.outcomes, out_dir / "ttft_cdf.png"),
            plot_ttft_timeline(result.outcomes, out_dir / "ttft_timeline.png")]


def summary_rows(result: BenchResult) -> list[list[object]]:
    rows: list[list[object]] = []
    groups = [("all", result.summary()), *result.by_model().items()]
    for name, s in groups:
        rows.append([name, s.num_requests, s.num_completed, s.ttft_s.p50, s.ttft_s.p95,
                     s.ttft_s.p99, s.tpot_s.p50, s.itl_s.p50, s.e2e_s.p50,
                     s.request_throughput_per_s, s.output_tokens_per_s,
                     "-" if s.slo_attainment is None else s.slo_attainment, s.goodput_per_s])
    return rows


SUMMARY_HEADERS = ["model", "requests", "done", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
                   "tpot_p50_s", "itl_p50_s", "e2e_p50_s", "req_per_s", "out_tok_per_s",
                   "slo_attain", "goodput_req_s"]


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

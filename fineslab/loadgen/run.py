"""Send a workload to an OpenAI-compatible endpoint and measure every request.

`run_benchmark(BenchConfig, requests)` sends each request at its arrival time (streamed
completions, prompts built to their lengths by `prompts.PromptBuilder`), and returns a
`BenchResult` with one `RequestOutcome` per request; `result_json`, `write_results` and
`summary_rows` report it (TTFT, TPOT, ITL, E2E, throughput, SLO attainment and goodput).
`python -m fineslab.bench.serve` is its command line; the profiler, the simulator's fidelity
check and the benchmarks call it directly.
"""

from __future__ import annotations

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

from fineslab.connections import pooled_connector
from fineslab.errors import ConfigError
from fineslab.loadgen.client import ClientConfig, send_request
from fineslab.loadgen.metrics import RequestOutcome, Summary, summarize, summarize_by_model
from fineslab.loadgen.prompts import PromptBuilder
from fineslab.workload import Request

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
    async with aiohttp.ClientSession(connector=pooled_connector()) as session:
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
    from fineslab.loadgen.plots import plot_ttft_cdf, plot_ttft_timeline

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

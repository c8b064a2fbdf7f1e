"""Step latencies of a live endpoint, measured over HTTP with the load generator.

The in-process profiler (`measure.py`) times `sglang.Engine.generate`; a request sent to a
served model also pays for HTTP, the router, tokenization, detokenization and the engine's
per-request work, which at the tiny CPU models' sizes is as large as the prefill itself (a
16-token prefill takes about 7 ms in-process and 20-30 ms through the server). These probes
time what a client sees, with requests that are not part of any workload:

    prefill_s(n)        a + beta * n fitted to the median TTFTs of lone requests with
                        n-token prompts and 1 output token
    decode step(b)      median TPOT of b concurrent requests, 16 output tokens (TPOT, not
                        the inter-chunk gap: a late detokenizer delivers tokens in bursts,
                        which makes the gaps bimodal while their sum stays right)

The probes run in rounds (every prompt length and batch size once per round, `repeats`
rounds), so that a change of the machine's load meets every point alike. Each point is the
median of its samples (not the minimum: the simulator should see the overhead a client
typically meets), and the prefill curve is the non-negative line `a + beta * n` fitted to the
medians (`measure.nnls_fit`): single TTFTs of the tiny model on a shared 2-core machine vary by
5x, and a line is what the in-process profile finds. Cost: `repeats` rounds of
`len(prefill_tokens)` lone requests and `len(batch_sizes)` decode batches, about 2 s a round
for llama-tiny on 2 idle cores.
Used by `fineslab.profile measure --via http` (a stored profile) and by
`fineslab.sim.experiments.calibrate` (the same probes minutes before a fidelity run).
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from fineslab.loadgen.run import BenchConfig, run_benchmark
from fineslab.workload import Request

logger = logging.getLogger(__name__)

PREFILL_TOKENS = (16, 64, 128, 256)
DECODE_BATCHES = (1, 4, 8)
DECODE_PROMPT_TOKENS = 16
DECODE_OUTPUT_TOKENS = 16


@dataclass(frozen=True)
class HttpTables:
    """What the probes measured: `prefill` (tokens, seconds) on the fitted line; `decode_steps`
    one step's seconds per batch size of `batch_sizes`; `raw` every sample, as JSON."""

    prefill: tuple[tuple[float, float], ...]
    batch_sizes: tuple[int, ...]
    decode_steps: tuple[float, ...]
    raw: str


def _probe_prefill(bench: BenchConfig, model: str, num_tokens: int, repeat: int
                   ) -> list[float]:
    request = Request(f"probe-p{num_tokens}-{repeat}", model, 0.0, num_tokens, 1)
    outcome = run_benchmark(bench, [request]).outcomes[0]
    return [] if outcome.ttft_s is None else [outcome.ttft_s]


def _probe_decode(bench: BenchConfig, model: str, batch_size: int, repeat: int
                  ) -> list[float]:
    requests = [Request(f"probe-d{batch_size}-{repeat}-{i}", model, 0.0,
                        DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS)
                for i in range(batch_size)]
    return [t for o in run_benchmark(bench, requests).outcomes if (t := o.tpot_s) is not None]


def _median(samples: list[float], what: str) -> float:
    if not samples:
        raise RuntimeError(f"no {what} probe completed")
    return statistics.median(samples)


def probe_tables(bench: BenchConfig, model: str, repeats: int,
                 prefill_tokens: tuple[int, ...] = PREFILL_TOKENS,
                 batch_sizes: tuple[int, ...] = DECODE_BATCHES) -> HttpTables:
    """Probe `model` at `bench`'s endpoint now (see the module docstring)."""
    from fineslab.profile.measure import nnls_fit

    raw_prefill: dict[int, list[float]] = {n: [] for n in prefill_tokens}
    raw_steps: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for repeat in range(repeats):  # rounds: a change of load meets every point alike
        for n in prefill_tokens:
            raw_prefill[n] += _probe_prefill(bench, model, n, repeat)
        for b in batch_sizes:
            raw_steps[b] += _probe_decode(bench, model, b, repeat)
    medians = [(float(n), _median(t, f"{n}-token prefill")) for n, t in raw_prefill.items()]
    intercept, slope = nnls_fit([[1.0, n] for n, _ in medians], [t for _, t in medians])
    prefill = tuple((n, intercept + slope * n) for n, _ in medians)
    steps = tuple(_median(t, f"batch-{b} decode") for b, t in raw_steps.items())
    logger.info("HTTP probes of %s: prefill medians %s, fit %s; decode steps %s", model,
                medians, prefill, steps)
    raw = json.dumps({"ttft_s": {str(n): [round(t, 5) for t in ts]
                                 for n, ts in raw_prefill.items()},
                      "tpot_s": {str(b): [round(t, 5) for t in ts]
                                 for b, ts in raw_steps.items()}})
    return HttpTables(prefill, tuple(batch_sizes), steps, raw)


def load_average() -> float:
    """The 1-minute load average (reported beside live measurements)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")

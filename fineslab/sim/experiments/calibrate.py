"""Measure a live endpoint's step latencies over HTTP, right before a fidelity run.

On a shared 2-core machine the speed of a CPU server changes by 5-10x with the load of other
jobs (a profile measured an hour earlier says 0.08 s per decode step; under a load average of
25 the same server takes 0.6 s), so a profile from `profiles/` says little about a run made
now. `calibrate` probes the endpoint itself, in the same minutes as the run, with requests
that are not part of the workload:

    prefill_s(n)        median TTFT of a lone request with an n-token prompt, 1 output token
    decode step(b)      median TPOT of b concurrent requests, 16 output tokens (TPOT, not
                        the inter-chunk gap: a late detokenizer delivers tokens in bursts,
                        which makes the gaps bimodal while their sum stays right)

and returns the base profile with those two tables replaced (HTTP, tokenization and
streaming overheads are inside the measured times, as they are in the workload's).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.profile_schema import DecodeTable, ModelProfile

from fineslab.bench.serve import BenchConfig, run_benchmark
from fineslab.workload import Request

logger = logging.getLogger(__name__)

PREFILL_TOKENS = (16, 64, 128, 256)
DECODE_BATCHES = (1, 4, 8)
DECODE_OUTPUT_TOKENS = 16
REPEATS = 2


def _probe_prefill(bench: BenchConfig, model: str, num_tokens: int) -> float:
    ttfts = []
    for repeat in range(REPEATS):
        request = Request(f"probe-p{num_tokens}-{repeat}", model, 0.0, num_tokens, 1)
        outcome = run_benchmark(bench, [request]).outcomes[0]
        if outcome.ttft_s is not None:
            ttfts.append(outcome.ttft_s)
    return statistics.median(ttfts)


def _probe_decode(bench: BenchConfig, model: str, batch_size: int) -> float:
    requests = [Request(f"probe-d{batch_size}-{i}", model, 0.0, 16, DECODE_OUTPUT_TOKENS)
                for i in range(batch_size)]
    tpots = [t for o in run_benchmark(bench, requests).outcomes if (t := o.tpot_s) is not None]
    return statistics.median(tpots)


def calibrate(base: ModelProfile, bench: BenchConfig, model: str) -> ModelProfile:
    """`base` with prefill and decode tables measured on the endpoint now."""
    prefill = [(float(n), _probe_prefill(bench, model, n)) for n in PREFILL_TOKENS]
    # Keep the curve non-decreasing (the schema requires it; noise can invert two points).
    for i in range(1, len(prefill)):
        prefill[i] = (prefill[i][0], max(prefill[i][1], prefill[i - 1][1]))
    steps = [_probe_decode(bench, model, b) for b in DECODE_BATCHES]
    contexts = base.decode.context_tokens
    decode = DecodeTable(DECODE_BATCHES, contexts,
                         tuple(tuple(s for _ in contexts) for s in steps))
    logger.info("calibrated: prefill %s, decode steps %s", prefill, steps)
    provenance = dict(base.provenance)
    provenance.update({"calibrated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "calibration": "fineslab.sim.experiments.calibrate over HTTP"})
    return replace(base, source="measured", prefill_s=PiecewiseLinear.from_points(prefill),
                   decode=decode, provenance=provenance)


def load_average() -> float:
    """The 1-minute load average (reported beside live measurements)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")

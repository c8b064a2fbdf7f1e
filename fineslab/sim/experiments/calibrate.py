"""Measure a live endpoint's step latencies over HTTP, right before a run.

On a shared 2-core machine the speed of a CPU server changes by 5-10x with the load of other
jobs (a profile measured an hour earlier says 0.08 s per decode step; under a load average of
25 the same server takes 0.6 s), so a stored profile can say little about a run made now.
`calibrate` probes the endpoint itself, in the same minutes as the run, with the probes of
`fineslab.profile.http_probe` (the ones `python -m fineslab.profile measure --via http`
stores), and returns the base profile with its prefill and decode tables replaced (HTTP,
tokenization and streaming overheads are inside the measured times, as they are in the
workload's). `fineslab.sim fidelity --calibrate` and the engine-policy benchmark use it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timezone

from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.profile_schema import DecodeTable, ModelProfile

from fineslab.loadgen.run import BenchConfig
from fineslab.profile.http_probe import PREFILL_TOKENS, load_average, probe_tables

__all__ = ["REPEATS", "calibrate", "load_average"]

logger = logging.getLogger(__name__)

REPEATS = 2


def calibrate(base: ModelProfile, bench: BenchConfig, model: str,
              prefill_tokens: tuple[int, ...] = PREFILL_TOKENS,
              repeats: int = REPEATS) -> ModelProfile:
    """`base` with prefill and decode tables measured on the endpoint now (prompts of
    `prefill_tokens`: probe the lengths the workload's SLO is set at, not a line beyond)."""
    tables = probe_tables(bench, model, repeats, prefill_tokens)
    contexts = base.decode.context_tokens
    decode = DecodeTable(tables.batch_sizes, contexts,
                         tuple(tuple(s for _ in contexts) for s in tables.decode_steps))
    provenance = dict(base.provenance)
    provenance.update({"calibrated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "calibration": "fineslab.sim.experiments.calibrate over HTTP"})
    return replace(base, source="measured", prefill_s=PiecewiseLinear.from_points(
        list(tables.prefill)), decode=decode, provenance=provenance)

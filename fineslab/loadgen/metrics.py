"""Per-request outcomes and the summary both the load generator and the simulator report.

The metrics follow `sglang.bench_serving` / `vllm bench serve`:

    TTFT    first token time - send (arrival) time
    TPOT    (e2e - TTFT) / (output_tokens - 1), per request with more than one output token
    ITL     gaps between consecutive streamed chunks (load generator only)
    E2E     last token time - arrival
    request throughput   completed requests / duration
    output throughput    output tokens of completed requests / duration
    duration             last completion - first arrival (the benchmark's wall time)
    SLO attainment       requests with TTFT <= their model's TTFT SLO / all requests
                         (a dropped or failed request counts as a miss)
    goodput              requests meeting the TTFT SLO / duration (req/s)

Percentiles are numpy's linear interpolation; a statistic over no samples is None, never 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50.0, 95.0, 99.0)


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request. `dropped` is the reason it got no answer, else None."""

    request_id: str
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    dropped: str | None = None
    ttft_slo_s: float | None = None
    itl_s: tuple[float, ...] = field(default=(), repr=False)

    @property
    def completed(self) -> bool:
        return self.dropped is None and self.e2e_s is not None

    @property
    def met_slo(self) -> bool:
        return (self.completed and self.ttft_s is not None and self.ttft_slo_s is not None
                and self.ttft_s <= self.ttft_slo_s)

    @property
    def tpot_s(self) -> float | None:
        if not self.completed or self.output_tokens < 2 or self.ttft_s is None:
            return None
        assert self.e2e_s is not None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        data = np.fromiter(values, dtype=np.float64)
        if data.size == 0:
            return cls(None, None, None, None)
        p50, p95, p99 = (float(v) for v in np.percentile(data, PERCENTILES))
        return cls(float(data.mean()), p50, p95, p99)


@dataclass(frozen=True)
class Summary:
    """Metrics of one group of requests (one model, or all)."""

    num_requests: int
    num_completed: int
    num_dropped: int
    duration_s: float
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    request_throughput_per_s: float
    output_tokens_per_s: float
    slo_attainment: float | None
    goodput_per_s: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(outcomes: Sequence[RequestOutcome]) -> Summary:
    """The summary of `outcomes` over their own duration (see the module docstring)."""
    done = [o for o in outcomes if o.completed]
    duration_s = _duration_s(outcomes)
    with_slo = [o for o in outcomes if o.ttft_slo_s is not None]
    met = sum(o.met_slo for o in outcomes)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        num_requests=len(outcomes), num_completed=len(done),
        num_dropped=sum(o.dropped is not None for o in outcomes), duration_s=duration_s,
        ttft_s=Distribution.of(o.ttft_s for o in done if o.ttft_s is not None),
        tpot_s=Distribution.of(t for o in done if (t := o.tpot_s) is not None),
        itl_s=Distribution.of(g for o in done for g in o.itl_s),
        e2e_s=Distribution.of(o.e2e_s for o in done if o.e2e_s is not None),
        request_throughput_per_s=len(done) * per_s,
        output_tokens_per_s=sum(o.output_tokens for o in done) * per_s,
        slo_attainment=met / len(with_slo) if with_slo else None,
        goodput_per_s=met * per_s,
    )


def summarize_by_model(outcomes: Sequence[RequestOutcome]) -> dict[str, Summary]:
    models = sorted({o.model for o in outcomes})
    return {m: summarize([o for o in outcomes if o.model == m]) for m in models}


def _duration_s(outcomes: Sequence[RequestOutcome]) -> float:
    if not outcomes:
        return 0.0
    start_s = min(o.arrival_s for o in outcomes)
    ends = [o.arrival_s + o.e2e_s for o in outcomes if o.e2e_s is not None]
    return max(ends) - start_s if ends else 0.0

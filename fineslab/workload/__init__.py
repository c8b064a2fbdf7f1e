"""Workloads shared by the load generator and the simulator: traces, arrivals, lengths.

    spec = WorkloadSpec(models=(ModelLoad("llama-3.1-8b-fp16", 0.5),), duration_s=60,
                        trace_path=Path("shared/traces/sharegpt_...csv"), rate_scale=8, seed=0)
    requests = build_workload(spec)     # list[Request], sorted by arrival, deterministic

Modules: traces (CSV readers), arrivals (Poisson, replay), spec (mix -> requests).
"""

from __future__ import annotations

from fineslab.workload.arrivals import poisson_arrivals, replay_arrivals, time_scale_for_rate
from fineslab.workload.spec import (
    ARRIVAL_KINDS,
    ModelLoad,
    Request,
    WorkloadSpec,
    build_workload,
    parse_mix,
)
from fineslab.workload.traces import (
    AZURE_CONV,
    SHAREGPT_STATS,
    ArrivalTrace,
    LengthTable,
    load_arrival_trace,
    load_lengths,
)

__all__ = [
    "ARRIVAL_KINDS", "AZURE_CONV", "SHAREGPT_STATS", "ArrivalTrace", "LengthTable", "ModelLoad",
    "Request", "WorkloadSpec",
    "build_workload", "load_arrival_trace", "load_lengths", "parse_mix", "poisson_arrivals",
    "replay_arrivals", "time_scale_for_rate",
]

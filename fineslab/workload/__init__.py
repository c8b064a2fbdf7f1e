"""Workloads shared by the load generator and the simulator: traces, arrivals, lengths.

    spec = WorkloadSpec(models=(ModelLoad("llama-3.1-8b-fp16", 0.5),), duration_s=60,
                        trace_path=SHAREGPT_STATS, rate_scale=8, seed=0)
    requests = build_workload(spec)     # list[Request], sorted by arrival, deterministic

    sessions = build_sessions(SessionSpec("qwen3-14b", load_lengths(SHAREGPT_STATS),
                                          num_sessions=200, session_rate_per_s=0.5))

Modules: traces (CSV readers), arrivals (Poisson, replay), spec (mix -> requests), sessions
(multi-turn chats whose prompts share a growing prefix).
"""

from __future__ import annotations

from fineslab.workload.arrivals import poisson_arrivals, replay_arrivals, time_scale_for_rate
from fineslab.workload.sessions import (
    Session,
    SessionSpec,
    SessionStats,
    SessionTurn,
    TimedTurn,
    build_sessions,
    open_loop_requests,
    summarize_sessions,
)
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
    "Request", "Session", "SessionSpec", "SessionStats", "SessionTurn", "TimedTurn",
    "WorkloadSpec", "build_sessions", "build_workload", "load_arrival_trace", "load_lengths",
    "open_loop_requests", "parse_mix", "poisson_arrivals", "replay_arrivals",
    "summarize_sessions", "time_scale_for_rate",
]

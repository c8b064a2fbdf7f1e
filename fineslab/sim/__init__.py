"""The discrete-event simulator: the real placer, local scheduler and slab table on a clock
driven by profiled latencies, for fleets of any size (`python -m fineslab.sim`).

    result = simulate(models, gpus, SYSTEMS["fineslab"], requests, window_s=60.0)
    result.summary().slo_attainment, result.window_tokens_per_s, result.plan.table()

Modules: config (SimConfig, the compared systems), kv (slab tables per GPU), engine (one
replica's step loop), simulator (placement, event loop, routing), experiments (fig10-13,
fidelity), __main__ (CLI). Assumptions are listed in docs/evaluation.md.
"""

from __future__ import annotations

from fineslab.sim.config import SYSTEMS, SimConfig, SystemSpec, get_system
from fineslab.sim.simulator import FleetModel, SimResult, Simulator, place, simulate

__all__ = [
    "SYSTEMS", "FleetModel", "SimConfig", "SimResult", "Simulator", "SystemSpec", "get_system",
    "place", "simulate",
]

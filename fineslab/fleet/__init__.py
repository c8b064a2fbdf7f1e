"""A launched fleet from the outside: `FleetHandle` starts `python -m fineslab.launch` from a
config, waits until it is ready (relaying its progress), reads its router, stops it and checks
that nothing of it is left. The tests, the benchmarks, the profiler and the notebooks all
drive fleets through it."""

from __future__ import annotations

from fineslab.fleet.handle import FleetHandle, FleetStartError, Leftovers, fleet_processes

__all__ = ["FleetHandle", "FleetStartError", "Leftovers", "fleet_processes"]

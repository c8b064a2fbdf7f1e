"""The launcher, `python -m fineslab.launch --config FLEET.yaml [--dry-run]`.

    config = load_fleet_config(path)        # YAML -> frozen FleetConfig, ConfigError on problems
    plan = make_plan(config)                # devices, profiles, global placer, arenas, runtimes
    print(plan.describe())                  # what --dry-run prints
    with Fleet(plan) as fleet:              # checkpoints, arenas, runtimes, health, router
        fleet.serve_forever()               # until SIGINT/SIGTERM; then everything is stopped

Modules: config (schema), profiles (profile lookup, CPU estimate), plan (placement and arena
sizing), runtimes (SGLang runtime specs and the supervisor that restarts them), fleet (the
whole lifecycle), __main__ (CLI).
"""

from __future__ import annotations

from fineslab.launch.config import DeviceConfig, FleetConfig, ModelConfig, load_fleet_config
from fineslab.launch.plan import FleetPlan, RuntimePlan, make_plan

__all__ = [
    "DeviceConfig", "FleetConfig", "FleetPlan", "ModelConfig", "RuntimePlan", "load_fleet_config",
    "make_plan",
]

"""The launcher's command line, `python -m fineslab.launch --config FLEET.yaml [--dry-run]`
(`fineslab launch`): it reads the config, plans the fleet and runs it, on this machine
(`fineslab.fleet`) or over a Ray cluster (`fineslab.cluster`). In code:

    config = load_fleet_config(path)        # YAML -> FleetConfig, ConfigError on problems
    plan = make_plan(config)                # devices, profiles, global placer, arenas, runtimes
    print(plan.describe())                  # what --dry-run prints
    with Fleet(plan) as fleet:              # checkpoints, arenas, runtimes, health, router
        ...                                 # (fineslab.fleet.config, .plan, .machine)
"""

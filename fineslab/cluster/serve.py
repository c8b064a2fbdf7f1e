"""Run a fleet over a Ray cluster until a signal (`python -m fineslab.launch` with `--ray` or a
config's `cluster:`): the driver places the models over the nodes, each node runs its share as a
one-machine fleet (`fineslab.fleet.serve.run_fleet`), the front router serves them all."""

from __future__ import annotations

from fineslab.fleet.config import FleetConfig
from fineslab.fleet.serve import progress, serve_until_signal


def run_cluster(config: FleetConfig, address: str | None, port: int | None = None,
                log_dir: str | None = None, stop_fd: int | None = None,
                dry_run: bool = False) -> int:
    """`run_fleet` over a Ray cluster (fineslab.cluster.driver); `dry_run`: the placement."""
    from fineslab.cluster.driver import ClusterFleet

    fleet = ClusterFleet(config, port, log_dir, progress, address)
    if dry_run:
        try:
            fleet.make_plan()
        finally:
            fleet.stop()
        return 0
    return serve_until_signal(fleet.start, fleet.stop, "cluster fleet", stop_fd)

"""`python -m fineslab.launch --config FLEET.yaml [--dry-run]`: plan, start, serve, stop."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fineslab.errors import FatalError
from fineslab.launch.config import FleetConfig, load_fleet_config
from fineslab.launch.plan import FleetPlan, make_plan

if TYPE_CHECKING:
    from fineslab.launch.fleet import Fleet

logger = logging.getLogger(__name__)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _progress(message: str) -> None:
    print(message, flush=True)


def stop_with_fd(fd: int) -> None:
    """SIGTERM this process (a clean stop) once `fd` reads EOF: the process holding the pipe's
    write end is gone, however it went (a test harness or tool killed with -9)."""
    try:
        os.fstat(fd)
    except OSError:
        raise FatalError(f"--stop-with-fd {fd}: no such open file descriptor") from None

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        logger.warning("the process holding --stop-with-fd %d is gone; stopping the fleet", fd)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-fd", daemon=True).start()


def serve_until_signal(start: Callable[[], None], stop: Callable[[], None], what: str,
                       stop_fd: int | None = None) -> int:
    """`start()`, print `ready`, serve until SIGINT/SIGTERM (EOF on `stop_fd` sends SIGTERM),
    then `stop()`, whatever phase `start` reached, with further signals ignored meanwhile.
    Both signals raise KeyboardInterrupt in the main thread."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    if stop_fd is not None:
        stop_with_fd(stop_fd)
    try:
        start()
        _progress("ready")
        threading.Event().wait()
    except KeyboardInterrupt:
        _progress(f"stopping the {what}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop()
    return 0


def run_fleet(plan: FleetPlan, port: int | None = None, log_dir: str | None = None,
              stop_fd: int | None = None,
              on_ready: Callable[[Fleet], None] | None = None) -> int:
    """Start the fleet, serve until SIGINT/SIGTERM, stop the router, every runtime's process
    group and the arenas. `on_ready(fleet)` runs once everything serves (a cluster node
    reports its router there)."""
    from fineslab.launch.fleet import Fleet

    fleet = Fleet(plan, port, log_dir, _progress)

    def start() -> None:
        fleet.start()
        if on_ready is not None:
            on_ready(fleet)

    return serve_until_signal(start, fleet.stop, "fleet", stop_fd)


def run_cluster(config: FleetConfig, address: str | None, port: int | None = None,
                log_dir: str | None = None, stop_fd: int | None = None,
                dry_run: bool = False) -> int:
    """`run_fleet` over a Ray cluster (fineslab.cluster.driver); `dry_run`: the placement."""
    from fineslab.cluster.driver import ClusterFleet

    fleet = ClusterFleet(config, port, log_dir, _progress, address)
    if dry_run:
        try:
            fleet.make_plan()
        finally:
            fleet.stop()
        return 0
    return serve_until_signal(fleet.start, fleet.stop, "cluster fleet", stop_fd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.launch", description=(
        "Start a fineslab fleet: place the models, create one KV arena per device, start one "
        "SGLang runtime per model replica, then serve the OpenAI API through the router."))
    parser.add_argument("--config", required=True, help="fleet YAML (see docs/serving.md)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--port", type=int, default=None, help="router port (overrides YAML)")
    parser.add_argument("--log-dir", default=None,
                        help="runtime logs (default: a temporary folder, printed at start)")
    parser.add_argument("--ray", default=None, metavar="ADDRESS",
                        help="serve over the nodes of the Ray cluster at ADDRESS ('auto': the "
                             "one this machine is part of); the config's `cluster:` does the "
                             "same (docs/cluster.md)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--stop-with-fd", type=int, default=None, metavar="FD",
                        help="stop the fleet when this inherited pipe reads EOF (its writer, "
                             "e.g. a test harness, is gone)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_fleet_config(args.config)
        if config.cluster is not None or args.ray is not None:
            return run_cluster(config, args.ray, port=args.port, log_dir=args.log_dir,
                               stop_fd=args.stop_with_fd, dry_run=args.dry_run)
        plan = make_plan(config)
        print(plan.describe(), flush=True)
        if args.dry_run:
            return 0
        return run_fleet(plan, port=args.port, log_dir=args.log_dir,
                         stop_fd=args.stop_with_fd)
    except FatalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

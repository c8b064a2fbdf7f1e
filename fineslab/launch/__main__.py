"""`python -m fineslab.launch --config FLEET.yaml [--dry-run]`: plan, start, serve, stop."""

from __future__ import annotations

import argparse
import logging
import sys

from fineslab.cluster.serve import run_cluster
from fineslab.errors import FatalError
from fineslab.fleet.config import load_fleet_config
from fineslab.fleet.plan import make_plan
from fineslab.fleet.serve import run_fleet


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

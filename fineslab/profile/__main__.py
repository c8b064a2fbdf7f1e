"""CLI: `python -m fineslab.profile {analytical,measure} ...` (see the package docstring)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fineslab.scheduler.devices import DEVICES
from fineslab.scheduler.profile_schema import save_profile
from fineslab.scheduler.roofline import paper_profiles

logger = logging.getLogger(__name__)


def _analytical(args: argparse.Namespace) -> int:
    for profile in paper_profiles(tuple(args.devices)):
        path = save_profile(profile, Path(args.out))
        logger.info("wrote %s", path)
    return 0


def _measure(args: argparse.Namespace) -> int:
    # Imported here: it imports sglang, which the analytical path must not need.
    from fineslab.profile.measure import MeasureConfig, run_measure

    http = args.via == "http"
    repeats = 2 if args.quick else (9 if http else 3)
    config = MeasureConfig(model=args.model, cache_dir=Path(args.cache_dir),
                           out_dir=Path(args.out), quick=args.quick, repeats=repeats)
    if http:
        from fineslab.profile.measure_http import run_measure_http
        from fineslab.profile.one_model import exit_on_sigterm

        exit_on_sigterm()  # a `timeout` stops the fleet through the `finally` blocks
        path = run_measure_http(config, args.url, args.served_model)
    elif args.url is not None:
        raise SystemExit("--url needs --via http")
    else:
        path = run_measure(config)
    logger.info("wrote %s", path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.profile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ana = sub.add_parser("analytical", help="write roofline profiles of the paper's models")
    ana.add_argument("--out", default="profiles")
    ana.add_argument("--devices", nargs="+", default=sorted(DEVICES), choices=sorted(DEVICES))
    ana.set_defaults(func=_analytical)
    mea = sub.add_parser("measure", help="profile a generated model with SGLang on this device")
    mea.add_argument("--model", default="llama-tiny", help="a fineslab.models.generate preset")
    mea.add_argument("--cache-dir", default=str(Path.home() / ".cache/fineslab/models"))
    mea.add_argument("--out", default="profiles")
    mea.add_argument("--quick", action="store_true", help="fewer points (for tests)")
    mea.add_argument("--via", choices=("engine", "http"), default="engine",
                     help="engine: time sglang.Engine in-process (<name>.json); http: probe "
                          "a launched one-model fleet through its router (<name>-http.json)")
    mea.add_argument("--url", default=None, help="with --via http: probe this endpoint instead")
    mea.add_argument("--served-model", default=None, help="with --url: the `model` field")
    mea.set_defaults(func=_measure)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

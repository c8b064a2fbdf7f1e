"""`python -m fineslab.models {generate,smollm2,list}`: fill the model cache."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fineslab.env import FineslabEnv
from fineslab.models import smollm2
from fineslab.models.generate import PRESETS, ensure_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.models", description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="model cache (default: $FINESLAB_MODEL_CACHE or "
                             "~/.cache/fineslab/models)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write generated presets (all by default)")
    gen.add_argument("--preset", action="append", choices=sorted(PRESETS))
    sub.add_parser("smollm2", help="download and convert SmolLM2-135M-Instruct")
    sub.add_parser("list", help="list presets and what the cache holds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    cache = args.cache_dir or Path(FineslabEnv.from_environ().model_cache_dir)
    if args.command == "generate":
        for name in args.preset or sorted(PRESETS):
            print(f"{name}: {ensure_model(name, cache)}")
    elif args.command == "smollm2":
        print(f"{smollm2.MODEL_NAME}: {smollm2.install(cache)}")
    else:
        for name, spec in sorted(PRESETS.items()):
            where = cache / name
            state = str(where) if where.exists() else "(not generated)"
            print(f"{name:14s} {spec.arch:6s} layers={spec.num_layers} hidden={spec.hidden_size} "
                  f"{state}")
        found = smollm2.find(cache)
        print(f"{smollm2.MODEL_NAME:14s} {found or '(not installed; setup --smollm2)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

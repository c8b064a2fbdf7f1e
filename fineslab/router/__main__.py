"""`python -m fineslab.router`: a router in front of runtimes that are already running.

    python -m fineslab.router --port 8000 --route tiny=http://127.0.0.1:30000 \
        [--route other=http://...] [--ttft-slo-s 10] [--tokenizer tiny=/models/llama-tiny]

Without a profile the local scheduler predicts a flat `--ttft-s` for any batch, so it only
drops what waits past its deadline. The launcher (`python -m fineslab.launch`) is the normal
way to get a router: it wires profiles, slab tables and supervision. This entry point serves
benchmarks and existing deployments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fineslab.router.app import Router
from fineslab.router.routes import ModelRoute, ReplicaRoute, RouterSettings
from fineslab.router.server import RouterServer
from fineslab.scheduler.predictors import FlatPredictor


def _pairs(values: list[str], flag: str) -> dict[str, list[str]]:
    pairs: dict[str, list[str]] = {}
    for value in values:
        name, sep, target = value.partition("=")
        if not sep or not name or not target:
            raise SystemExit(f"{flag} expects NAME=VALUE, got {value!r}")
        pairs.setdefault(name, []).append(target)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.router", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--route", action="append", required=True,
                        help="MODEL=BASE_URL (repeat for replicas and models)")
    parser.add_argument("--tokenizer", action="append", default=[], help="MODEL=MODEL_DIR")
    parser.add_argument("--ttft-slo-s", type=float, default=10.0)
    parser.add_argument("--ttft-s", type=float, default=0.01, help="flat TTFT prediction")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tokenizers = {k: v[0] for k, v in _pairs(args.tokenizer, "--tokenizer").items()}
    routes = [
        ModelRoute(name, tuple(ReplicaRoute(f"{name}-r{i}", url) for i, url in enumerate(urls)),
                   args.ttft_slo_s, FlatPredictor(args.ttft_s), tokenizers.get(name),
                   args.context_tokens, max_running_requests=args.max_running)
        for name, urls in _pairs(args.route, "--route").items()]
    server = RouterServer(Router(routes, RouterSettings(api_key=args.api_key)), args.host,
                          args.port)
    print(f"router on {server.base_url}", flush=True)
    server.serve_in_foreground()
    return 0


if __name__ == "__main__":
    sys.exit(main())

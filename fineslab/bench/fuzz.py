"""Fuzz the router's OpenAI endpoints: no body may get a 5xx, reset a connection or hurt a runtime.

    python -m fineslab.bench.fuzz --json [--cases 1000] [--seed 0] [--target URL]

Without `--target` it starts its own router (in this process) in front of the echo backend
(`fineslab.router.testing`), with a generated model's real tokenizer and vocabulary: seconds,
no SGLang; CI runs it short. With `--target` it fuzzes a running fleet, e.g. the demo
(`python -m fineslab.launch --config examples/cpu-demo.yaml`), real runtimes behind it.

The cases: first the hostile requests that broke the router or a runtime (issue #15: a token
id past the vocabulary, a lone surrogate, 10,000 nested `[`, `n: 0`, `max_tokens: 0`, NaN,
a body over the limit, unknown paths and methods), then `--cases` bodies drawn by hypothesis
(seeded): OpenAI-shaped objects whose every field may be of the wrong type or out of range,
and raw bytes (truncated JSON, random bytes, huge numbers). All go over one keep-alive
connection, so a reset is seen by the next request. Valid requests are capped at 8 new
tokens, so real runtimes answer fast.

Keys (last line, JSON): `cases`, `server_errors` (5xx), `resets` (a connection broken under a
request), `bad_error_shape` (an error not in the OpenAI shape), `health_ok` (/health is 200
with every runtime up and none restarted), `statuses` (a histogram), `seconds`.
Target: server_errors 0, resets 0, bad_error_shape 0, health_ok true.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx

from fineslab.bench.fuzz_cases import MAX_NEW_TOKENS, hostile_cases, random_cases

PATHS = ("/v1/completions", "/v1/chat/completions")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000, help="drawn cases (max 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default=None, help="a running router's base URL")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    return parser


@contextlib.contextmanager
def own_router() -> Iterator[str]:
    """A router in this process over the echo backend, serving `llama-tiny` as `llama-bf16`."""
    from fineslab.env import FineslabEnv
    from fineslab.models.generate import ensure_model
    from fineslab.router import ModelRoute, ReplicaRoute, Router, RouterServer, RouterSettings
    from fineslab.router.testing import FixedTtftPredictor, start_echo_backend
    from fineslab.runtime import free_port

    model_dir = ensure_model("llama-tiny", FineslabEnv.from_environ().model_cache_dir)
    config = json.loads((model_dir / "config.json").read_text())
    port = free_port()
    backend = start_echo_backend(port)
    route = ModelRoute("llama-bf16", (ReplicaRoute("llama-bf16-r0", f"http://127.0.0.1:{port}"),),
                       60.0, FixedTtftPredictor(), tokenizer_dir=str(model_dir),
                       context_tokens=int(config["max_position_embeddings"]),
                       vocab_size=int(config["vocab_size"]))
    server = RouterServer(Router([route], RouterSettings()))
    server.start()
    try:
        yield server.base_url
    finally:
        server.stop()
        backend.terminate()
        backend.wait(10)


def _served(client: httpx.Client) -> tuple[list[str], dict[str, int]]:
    """The target's models and each one's context, from /v1/models."""
    data = client.get("/v1/models").json()["data"]
    return [m["id"] for m in data], {m["id"]: int(m.get("max_model_len", 2048)) for m in data}


def _error_shape_ok(reply: httpx.Response) -> bool:
    try:
        error = reply.json()["error"]
        return isinstance(error, dict) and {"message", "type", "code"} <= set(error)
    except (ValueError, KeyError, TypeError):
        return False


def _send(client: httpx.Client, method: str, path: str, body: bytes) -> httpx.Response:
    return client.request(method, path, content=body, timeout=120,
                          headers={"content-type": "application/json"})


def run(base_url: str, num_cases: int, seed: int) -> dict[str, Any]:
    statuses: Counter[int] = Counter()
    server_errors, resets, bad_shape, cases = 0, 0, 0, 0
    examples: list[str] = []
    start_s = time.monotonic()
    with httpx.Client(base_url=base_url) as client:
        models, contexts = _served(client)
        rng = random.Random(seed)
        drawn = random_cases(models, contexts, min(num_cases, 2000), seed)
        for method, path, body in [*hostile_cases(models), *drawn]:
            path = path or rng.choice(PATHS)
            cases += 1
            try:
                reply = _send(client, method, path, body)
            except httpx.TransportError as exc:
                resets += 1
                examples.append(f"reset: {type(exc).__name__} on {body[:120]!r}")
                continue
            statuses[reply.status_code] += 1
            if reply.status_code >= 500:
                server_errors += 1
                examples.append(f"{reply.status_code}: {body[:120]!r} -> {reply.text[:200]}")
            elif reply.status_code >= 400 and not _error_shape_ok(reply):
                bad_shape += 1
                examples.append(f"shape {reply.status_code}: {reply.text[:200]}")
        try:
            health = client.get("/health", timeout=30)
            status = health.status_code
            replicas = [r for rs in health.json().get("models", {}).values() for r in rs]
        except (httpx.HTTPError, ValueError, AttributeError):
            status, replicas = 0, []
    health_ok = (status == 200 and bool(replicas)
                 and all(r["state"] == "up" and r["restarts"] == 0 for r in replicas))
    return {"cases": cases, "server_errors": server_errors, "resets": resets,
            "bad_error_shape": bad_shape, "health_ok": health_ok,
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "max_new_tokens": MAX_NEW_TOKENS, "seed": seed,
            "seconds": round(time.monotonic() - start_s, 1), "examples": examples[:10]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.target:
        result = run(args.target.rstrip("/"), args.cases, args.seed)
    else:
        with own_router() as url:
            result = run(url, args.cases, args.seed)
    for key in ("cases", "server_errors", "resets", "bad_error_shape", "health_ok",
                "statuses", "seconds"):
        print(f"{key:>16}: {result[key]}")
    for example in result["examples"]:
        print(f"  e.g. {example}")
    if args.json:
        print(json.dumps(result))
    ok = (result["server_errors"] == 0 and result["resets"] == 0
          and result["bad_error_shape"] == 0 and result["health_ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

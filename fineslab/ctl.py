"""`fineslab ctl`: list, sleep and wake the models of a running fleet (its router's admin API).

    fineslab ctl list                   every model: state, idle time, weight slabs, wakes
    fineslab ctl sleep MODEL            put an elastic model to sleep now
    fineslab ctl wake MODEL             wake it now
    options: --url http://127.0.0.1:8000 (the router), --api-key-env VAR (when the fleet has a key)

Exit status 0 on success, 1 when the router refused (the reason is printed), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from fineslab.bench.report import format_table

TIMEOUT_S = 300.0


class CtlError(Exception):
    pass


def request(url: str, method: str, path: str, api_key: str | None) -> Any:
    """One admin call; the decoded JSON answer, or CtlError with the router's message."""
    try:
        req = urllib.request.Request(url.rstrip("/") + path, method=method,
                                     data=b"" if method == "POST" else None)
    except ValueError:
        raise CtlError(f"--url {url!r} is not an http:// URL") from None
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as reply:
            body = reply.read()
        return json.loads(body)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        retry = exc.headers.get("Retry-After")
        raise CtlError(f"{exc.code}: {message}" + (f" (retry after {retry} s)" if retry else "")
                       ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CtlError(f"cannot reach the router at {url}: {reason}") from None
    except ValueError:
        raise CtlError(f"{url}{path} did not answer JSON: is it a fineslab router?") from None


def _table(models: list[dict[str, Any]]) -> str:
    rows = [[m["model"], m["state"], "yes" if m.get("elastic") else "no",
             "pinned" if m.get("pinned") else (m.get("idle_timeout_s") or "-"),
             m.get("idle_for_s", "-"), m.get("weight_slabs") or "-",
             m.get("sleeps", "-"), m.get("wakes", "-"), m.get("evictions", "-"),
             "-" if m.get("last_wake_s") is None else f"{m['last_wake_s']:.3f}"]
            for m in models]
    return format_table(["model", "state", "elastic", "idle timeout s", "idle for s",
                         "weight slabs", "sleeps", "wakes", "evictions", "last wake s"], rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fineslab ctl", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the fleet's router")
    parser.add_argument("--api-key-env", help="environment variable holding the API key")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every model and its state")
    for name in ("sleep", "wake"):
        one = sub.add_parser(name, help=f"{name} an elastic model now")
        one.add_argument("model")
    return parser


def run_client(prog: str, url: str, api_key_env: str | None,
               work: Callable[[str | None], int]) -> int:
    """A command-line client of the admin API (`ctl`, `top`): the API key from `api_key_env`
    (2 when that variable is unset), then `work(api_key)`; the router's refusals and answers
    that are not a router's are one line on stderr and exit status 1."""
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        print(f"{prog}: {api_key_env} is not set", file=sys.stderr)
        return 2
    try:
        return work(api_key)
    except CtlError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
    except (KeyError, TypeError):
        print(f"{prog}: {url} did not answer as a fineslab router does", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def work(api_key: str | None) -> int:
        if args.command == "list":
            print(_table(request(args.url, "GET", "/admin/models", api_key)["models"]))
            return 0
        path = f"/admin/models/{urllib.parse.quote(args.model, safe='')}/{args.command}"
        done = request(args.url, "POST", path, api_key)
        print(f"{done['model']}: {done['state']}"
              + (f" (woke in {done['last_wake_s']:.3f} s)"
                 if args.command == "wake" and done.get("last_wake_s") else ""))
        return 0

    return run_client("fineslab ctl", args.url, args.api_key_env, work)


if __name__ == "__main__":
    sys.exit(main())

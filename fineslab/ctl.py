"""`fineslab ctl`: list, sleep, wake and limit the models of a running fleet (the router's
admin API, fineslab/router/admin.py).

    fineslab ctl list                   every model: state, idle time, weight slabs, KV limit
    fineslab ctl sleep MODEL            put an elastic model to sleep now
    fineslab ctl wake MODEL             wake it now
    fineslab ctl limit MODEL SIZE       cap the KV each runtime of MODEL may hold in the arena:
                                        512M, 1.5G, 2GiB, 1048576 (bytes); `none` lifts the cap
    options: --url URL (the router; default $FINESLAB_FLEET_URL, else the one fleet running on
             this machine, else http://127.0.0.1:8000), --api-key-env VAR (when it has a key)

Exit status 0 on success, 1 when the router refused (the reason is printed), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fineslab.proctree import running_routers
from fineslab.slabs.inspector import human_bytes
from fineslab.slabs.limits import MAX_KV_LIMIT
from fineslab.tables import format_table

DEFAULT_URL = "http://127.0.0.1:8000"
#: The fleet to drive when --url is not given (the notebooks read it too).
FLEET_URL_VAR = "FINESLAB_FLEET_URL"

TIMEOUT_S = 300.0


class CtlError(Exception):
    pass


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int | None:
    """`512M`, `1.5g`, `2GiB`, `64KB`, `1048576` -> bytes (binary units); `none` -> None."""
    spoken = text.strip().lower()
    if spoken in ("none", "off", "unlimited"):
        return None
    number = spoken.removesuffix("ib").removesuffix("b")
    unit = number[-1:] if number[-1:] in _UNITS else ""
    try:
        value = float(number[: len(number) - len(unit)])
    except ValueError:
        raise CtlError(f"size {text!r} is not a size: try 512M, 1.5G, 2GiB or none") from None
    if not value >= 0 or value == float("inf"):
        raise CtlError(f"size {text!r} must be a finite size >= 0")
    size = int(value * _UNITS[unit])
    if size > MAX_KV_LIMIT:
        raise CtlError(f"size {text!r} is over {human_bytes(MAX_KV_LIMIT)}: no arena is that "
                       "large (none for no limit)")
    return size


def _size_argument(text: str) -> int | None:
    try:
        return parse_size(text)
    except CtlError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def request(url: str, method: str, path: str, api_key: str | None,
            body: dict[str, Any] | None = None) -> Any:
    """One admin call; the decoded JSON answer, or CtlError with the router's message."""
    data = json.dumps(body).encode() if body is not None else b"" if method == "POST" else None
    try:
        req = urllib.request.Request(url.rstrip("/") + path, method=method, data=data)
    except ValueError:
        raise CtlError(f"--url {url!r} is not an http:// URL") from None
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as reply:
            answer = reply.read()
        return json.loads(answer)
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


def limit_text(limits: dict[str, int | None] | None) -> str:
    """A model's KV limit for a table cell: one figure when its runtimes share it."""
    values = set((limits or {}).values())
    if not values or values == {None}:
        return "-"
    return ", ".join("-" if v is None else human_bytes(v) for v in sorted(
        values, key=lambda v: -1 if v is None else v))


def streaming_text(streaming: dict[str, dict[str, Any]] | None) -> str:
    """A model's lent layers for a table cell: `[1, 3] 4.0 MiB` per runtime, `-` for none."""
    cells = [f"{s['layers']} {human_bytes(s['lent_bytes'])}" for s in (streaming or {}).values()
             if s.get("layers")]
    return "; ".join(cells) or "-"


def _table(models: list[dict[str, Any]]) -> str:
    rows = [[m["model"], m["state"], "yes" if m.get("elastic") else "no",
             "pinned" if m.get("pinned") else (m.get("idle_timeout_s") or "-"),
             m.get("idle_for_s", "-"), m.get("weight_slabs") or "-",
             limit_text(m.get("kv_limits")), streaming_text(m.get("streaming")),
             m.get("sleeps", "-"), m.get("wakes", "-"), m.get("evictions", "-"),
             "-" if m.get("last_wake_s") is None else f"{m['last_wake_s']:.3f}"]
            for m in models]
    return format_table(["model", "state", "elastic", "idle timeout s", "idle for s",
                         "weight slabs", "KV limit", "layers lent", "sleeps", "wakes",
                         "evictions",
                         "last wake s"], rows)


URL_HELP = (f"the fleet's router (default: ${FLEET_URL_VAR}, else the one fleet running on this "
            f"machine, else {DEFAULT_URL})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fineslab ctl",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--url", default=None, help=URL_HELP)
    parser.add_argument("--api-key-env", help="environment variable holding the API key")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every model and its state")
    for name in ("sleep", "wake"):
        one = sub.add_parser(name, help=f"{name} an elastic model now")
        one.add_argument("model")
    limit = sub.add_parser("limit", help="cap the KV a model's runtimes may hold in the arena")
    limit.add_argument("model")
    limit.add_argument("size", type=_size_argument, help="512M, 1.5G, 2GiB, bytes, or none")
    return parser


def router_url(given: str | None, shm_dir: Path | None = None) -> str:
    """The router to talk to: `--url`, else $FINESLAB_FLEET_URL, else the one fleet running on
    this machine (its launcher's run record), else the default port; CtlError when several run
    (they are named, with their URLs)."""
    if given:
        return given
    if os.environ.get(FLEET_URL_VAR):
        return os.environ[FLEET_URL_VAR]
    running = running_routers(shm_dir)
    if len(running) > 1:
        raise CtlError("several fleets run on this machine; pick one with --url: "
                       + ", ".join(f"{fleet} {url}" for fleet, url in sorted(running.items())))
    return next(iter(running.values()), DEFAULT_URL)


def run_client(prog: str, url: str | None, api_key_env: str | None,
               work: Callable[[str, str | None], int]) -> int:
    """A command-line client of the admin API (`ctl`, `top`): the router (`router_url`; 2 when
    it is ambiguous), the API key from `api_key_env` (2 when that variable is unset), then
    `work(url, api_key)`; the router's refusals and answers that are not a router's are one
    line on stderr and exit status 1."""
    try:
        url = router_url(url)
    except CtlError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        print(f"{prog}: {api_key_env} is not set", file=sys.stderr)
        return 2
    try:
        return work(url, api_key)
    except CtlError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
    except (KeyError, TypeError):
        print(f"{prog}: {url} did not answer as a fineslab router does", file=sys.stderr)
    return 1


def _negative_sizes_as_values(argv: Sequence[str]) -> list[str]:
    """`limit MODEL -5M`: argparse reads `-5M` as an option ("the following arguments are
    required: size"); after `--` it is the size, refused in words (a size >= 0)."""
    args = list(argv)
    for i, arg in enumerate(args):
        if re.fullmatch(r"-\d[\w.]*", arg) and "--" not in args[:i]:
            return [*args[:i], "--", *args[i:]]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(
        _negative_sizes_as_values(sys.argv[1:] if argv is None else argv))

    def work(url: str, api_key: str | None) -> int:
        if args.command == "list":
            print(_table(request(url, "GET", "/admin/models", api_key)["models"]))
            return 0
        path = f"/admin/models/{urllib.parse.quote(args.model, safe='')}/{args.command}"
        if args.command == "limit":
            done = request(url, "POST", path, api_key, {"kv_bytes": args.size})
            print(f"{done['model']}: KV limit {limit_text(done['kv_limits'])} per runtime")
            return 0
        done = request(url, "POST", path, api_key)
        print(f"{done['model']}: {done['state']}"
              + (f" (woke in {done['last_wake_s']:.3f} s)"
                 if args.command == "wake" and done.get("last_wake_s") else ""))
        return 0

    return run_client("fineslab ctl", args.url, args.api_key_env, work)


if __name__ == "__main__":
    sys.exit(main())

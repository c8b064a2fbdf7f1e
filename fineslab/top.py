"""`fineslab top`: a live view of a running fleet's arenas, refreshed every second.

    fineslab top [--url http://127.0.0.1:8000] [--interval 1] [--once] [--api-key-env VAR]

Per device: the arena's size and free space; per model on it: its state (awake, asleep,
sleeping, waking; `serving` for a model that never sleeps), its weight slabs, the KV it uses
and the slabs its KV holds alone (a key pool's slabs are shared, so they are shown per key in
`fineslab slabs`), and its KV limit (`fineslab ctl limit`). Owners of the table that no model
of the router accounts for (a runtime of another tool, a dead one) are listed by name. It reads
the router's `/health`, `/admin/models` and `/admin/arenas`; `--once` prints one frame and
exits (for scripts). Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from fineslab.ctl import URL_HELP, request, run_client
from fineslab.slabs.inspector import human_bytes
from fineslab.tables import format_table

CLEAR = "\x1b[H\x1b[2J"


def frame(url: str, api_key: str | None) -> str:
    """One screen of the view (module doc)."""
    health = request(url, "GET", "/health", api_key)
    states = {m["model"]: m["state"]
              for m in request(url, "GET", "/admin/models", api_key)["models"]}
    arenas: dict[str, Any] = request(url, "GET", "/admin/arenas", api_key)["arenas"]
    runtimes = {r["runtime_id"]: model for model, replicas in health["models"].items()
                for r in replicas}
    lines = [f"fineslab top  {url}  {time.strftime('%H:%M:%S')}  fleet {health['status']}", ""]
    for device, arena in sorted(arenas.items()):
        slab = arena["slab_bytes"]
        total = arena["num_slabs"] * slab
        lines.append(f"{device}: arena {human_bytes(total)} ({arena['num_slabs']} slabs of "
                     f"{human_bytes(slab)}), free {human_bytes(arena['free_bytes'])} "
                     f"({arena['free_bytes'] / total:.0%})" if total else f"{device}: empty")
        rows: dict[str, list[Any]] = {}
        for owner in arena["owners"]:
            rid = str(owner["runtime_id"])
            base, weights = (rid[:-2], True) if rid.endswith(":w") else (rid, False)
            model = runtimes.get(base)
            row = rows.setdefault(base, [model or "-", base, states.get(model, "serving")
                                         if model else ("alive" if owner["alive"] else "DEAD"),
                                         0, 0, 0, "-"])
            if weights:
                row[3] += owner["slabs"] * slab
            else:
                row[4] += owner["used_bytes"]
                row[5] += 0 if owner["pooled"] else owner["slabs"]
                limit = owner.get("kv_limit_bytes")
                row[6] = "-" if limit is None else human_bytes(limit)
        table = [[m, rid, state, human_bytes(w), human_bytes(kv), own, limit]
                 for m, rid, state, w, kv, own, limit in sorted(rows.values(),
                                                                key=lambda r: r[1])]
        lines += [format_table(["model", "runtime", "state", "weights", "KV used",
                                "KV slabs (own)", "KV limit"], table)
                  if table else "(no runtime attached)",
                  ""]
    if not arenas:
        lines.append("this fleet has no slab arena (kv_pool: sglang)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fineslab top",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--url", default=None, help=URL_HELP)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--api-key-env", help="environment variable holding the API key")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        print("fineslab top: --interval must be positive", file=sys.stderr)
        return 2

    def work(url: str, api_key: str | None) -> int:
        try:
            while True:
                text = frame(url, api_key)
                if args.once:
                    print(text)
                    return 0
                sys.stdout.write(CLEAR + text + "\n")
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0

    return run_client("fineslab top", args.url, args.api_key_env, work)


if __name__ == "__main__":
    sys.exit(main())

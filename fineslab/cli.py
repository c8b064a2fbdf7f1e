"""The `fineslab` console script: one entry point for the package's command-line tools.

    fineslab launch --config FLEET.yaml [--dry-run]   same as python -m fineslab.launch
    fineslab slabs ...                                 same as python -m fineslab.slabs
    fineslab models ...                                same as python -m fineslab.models
    fineslab profile ...                               same as python -m fineslab.profile
    fineslab ctl list|sleep MODEL|wake MODEL           same as python -m fineslab.ctl
    fineslab top [--url URL] [--once]                  same as python -m fineslab.top

Each subcommand hands the rest of the command line to that module's `main`, imported only when
chosen (so `fineslab models list` never imports SGLang or torch).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("fineslab.launch.__main__", "start a fleet: placement, arenas, runtimes, router"),
    "slabs": ("fineslab.slabs.inspector", "inspect a device's slab table"),
    "models": ("fineslab.models.__main__", "generate or list the built-in models"),
    "profile": ("fineslab.profile.__main__", "write measured or analytical profiles"),
    "ctl": ("fineslab.ctl", "list, sleep and wake the models of a running fleet"),
    "top": ("fineslab.top", "a live view of a running fleet's arenas and models"),
}


def _usage() -> str:
    lines = ["usage: fineslab {" + ",".join(SUBCOMMANDS) + "} [args...]", "", "subcommands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines.append("\n`fineslab <subcommand> --help` shows a subcommand's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"fineslab: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"fineslab {name}", *rest]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    entry: Callable[[list[str]], int | None] = module.main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

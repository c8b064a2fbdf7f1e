"""The `fineslab` console script: one entry point for the package's command-line tools.

    fineslab launch --config FLEET.yaml [--dry-run]   same as python -m fineslab.launch
    fineslab slabs ...                                 same as python -m fineslab.slabs
    fineslab models ...                                same as python -m fineslab.models
    fineslab profile ...                               same as python -m fineslab.profile
    fineslab ctl list|sleep MODEL|wake MODEL           same as python -m fineslab.ctl
    fineslab top [--url URL] [--once]                  same as python -m fineslab.top
    fineslab bench NAME ...                            same as python -m fineslab.bench.NAME
    fineslab sim ...                                   same as python -m fineslab.sim

Each subcommand hands the rest of the command line to that module's `main`, imported only when
chosen (so `fineslab models list` never imports SGLang or torch). `fineslab bench` alone lists
the benchmarks (every module of fineslab/bench with a `main`, by its docstring's first line).
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("fineslab.launch.__main__", "start a fleet: placement, arenas, runtimes, router"),
    "slabs": ("fineslab.slabs.inspector", "inspect a device's slab table"),
    "models": ("fineslab.models.__main__", "generate or list the built-in models"),
    "profile": ("fineslab.profile.__main__", "write measured or analytical profiles"),
    "ctl": ("fineslab.ctl", "list, sleep and wake the models of a running fleet"),
    "top": ("fineslab.top", "a live view of a running fleet's arenas and models"),
    "bench": ("", "run a benchmark (fineslab bench lists them)"),
    "sim": ("fineslab.sim.__main__", "the simulator's experiments (the papers' figures)"),
}
BENCH_DIR = Path(__file__).resolve().parent / "bench"


def benchmarks() -> dict[str, str]:
    """name -> the first line of its docstring, for each module of fineslab/bench with a
    `main` (read from the source: listing them imports none)."""
    found = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            doc = (ast.get_docstring(tree) or "").strip().splitlines()
            found[path.stem] = doc[0].removeprefix("Benchmark: ") if doc else ""
    return found


def _bench_usage() -> str:
    lines = ["usage: fineslab bench NAME [args...]", "", "benchmarks:"]
    lines += [f"  {name:<16} {text}" for name, text in benchmarks().items()]
    lines.append("\n`fineslab bench NAME --help` shows a benchmark's options.")
    return "\n".join(lines)


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
    module_name = SUBCOMMANDS[name][0]
    if name == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0 if rest else 2
        if rest[0] not in benchmarks():
            print(f"fineslab bench: unknown benchmark {rest[0]!r}\n\n{_bench_usage()}",
                  file=sys.stderr)
            return 2
        module_name, name, rest = f"fineslab.bench.{rest[0]}", f"bench {rest[0]}", rest[1:]
    sys.argv = [f"fineslab {name}", *rest]
    module = importlib.import_module(module_name)
    entry: Callable[[list[str]], int | None] = module.main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Check commands against their programs' own argument parsers, without running them.

    python -m fineslab.bench.check_commands 'NAME|MODULE ARG ...' ...

Each entry is in the form scripts/gpu_check.sh holds its commands in: a name, `|`, then what
follows `python -m` (split on whitespace, as the script's unquoted expansion splits it).
- `pytest ARGS`: checked by collection (`python -m pytest --collect-only ARGS`, in a child
  process), so its options, markers and paths must resolve and every test module selected must
  import. Pytest exits 5 when no test is selected, which counts as broken too: a marker that
  selects nothing is a command that checks nothing.
- any other module: imported, and ARGS parsed by its `parse_args(argv)` if it has one (a
  benchmark with rules across options, e.g. `fineslab.bench.pool`), else by
  `build_parser().parse_args(argv)`. A module with neither is broken: its command cannot be
  checked. Nothing is run.

Why: the GPU script runs where a GPU is lent, rarely and never in CI; a flag that a benchmark
does not have (`--device cuda` to a CPU-only parser) then wastes that machine. This check runs on
any machine (`bash scripts/gpu_check.sh --check`, in CI through tests/test_gpu_check_script.py).
Cost: the imports, and pytest's collection (about 20 s for the whole suite here).
Prints one line per entry; exits 1 naming every broken entry, 0 if all parse.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One `NAME|MODULE ARG ...` entry."""

    name: str
    module: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, entry: str) -> Command:
        name, sep, command = entry.partition("|")
        words = command.split()
        if not sep or not name.strip() or not words:
            raise ValueError(f"entry {entry!r} is not 'NAME|MODULE ARG ...'")
        return cls(name.strip(), words[0], tuple(words[1:]))

    def __str__(self) -> str:
        return " ".join(("python -m", self.module, *self.args))


def check_pytest(args: Sequence[str]) -> str | None:
    """None if pytest collects at least one test with `args`, else why not."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=600, check=False)
    if result.returncode == 0:
        return None
    lines = (result.stdout + result.stderr).strip().splitlines()
    return f"pytest --collect-only exited {result.returncode}: {' / '.join(lines[-3:])}"


def _parser_of(module: object) -> Callable[[list[str]], argparse.Namespace] | None:
    parse_args = getattr(module, "parse_args", None)
    if callable(parse_args):
        return parse_args
    build_parser = getattr(module, "build_parser", None)
    if callable(build_parser):
        parser = build_parser()
        if isinstance(parser, argparse.ArgumentParser):
            return parser.parse_args
    return None


def check_module(module_name: str, args: Sequence[str]) -> str | None:
    """None if `module_name`'s own parser accepts `args`, else why not."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module that fails to import, whatever the reason
        return f"cannot import {module_name}: {type(exc).__name__}: {exc}"
    parse = _parser_of(module)
    if parse is None:
        return f"{module_name} has no build_parser() or parse_args(argv) to check against"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parse(list(args))
    except SystemExit as exc:  # argparse's way out, on an error (2) or --help (0)
        message = stderr.getvalue().strip().splitlines()
        return message[-1] if message else f"the parser exited {exc.code} (--help?)"
    return None


def check(command: Command) -> str | None:
    """None if `command` would start as written, else why not."""
    if command.module == "pytest":
        return check_pytest(command.args)
    return check_module(command.module, command.args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.check_commands",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("entries", nargs="+", metavar="'NAME|MODULE ARG ...'")
    entries = parser.parse_args(argv).entries
    try:
        commands = [Command.parse(entry) for entry in entries]
    except ValueError as exc:
        parser.error(str(exc))
    broken = []
    for command in commands:
        problem = check(command)
        sys.stdout.write(f"{'ok' if problem is None else 'BROKEN':6} {command.name}: {command}"
                         f"{'' if problem is None else f'  -- {problem}'}\n")
        if problem is not None:
            broken.append(command.name)
    sys.stdout.flush()
    if broken:
        sys.stderr.write(f"check_commands: {len(broken)} broken command(s): "
                         f"{', '.join(broken)}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Output shared by all benchmarks: a human table, then (with --json) one JSON line.

The JSON line is the contract scripts read (`... --json | tail -n 1`); the table is for people.
`python -m fineslab.bench.report FILE.json ...` reads such lines back (one per file, the file's
name the benchmark's) and prints every figure in one table: scripts/gpu_check.sh ends with it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from fineslab.tables import emit


def flatten(result: Mapping[str, object], prefix: str = "") -> list[tuple[str, object]]:
    """(key, value) of every figure in `result`, a nested mapping's as `outer.inner`."""
    rows: list[tuple[str, object]] = []
    for key, value in sorted(result.items()):
        if isinstance(value, Mapping):
            rows += flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def read_result(path: Path) -> dict[str, object]:
    """The JSON object on the last line of `path`; ValueError if there is none."""
    lines = path.read_text().strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: the last line is not JSON ({exc})") from exc
    if not isinstance(result, dict):
        raise ValueError(f"{path}: the last line is not a JSON object")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.report",
                                     description="one table of the figures in benchmarks' "
                                                 "JSON lines")
    parser.add_argument("files", nargs="+", type=Path, help="<benchmark name>.json")
    parser.add_argument("--title", default="Figures measured")
    args = parser.parse_args(argv)
    rows: list[list[object]] = []
    unreadable = 0
    for path in args.files:
        try:
            figures = flatten(read_result(path))
        except (OSError, ValueError) as exc:
            figures, unreadable = [("(unreadable)", str(exc))], unreadable + 1
        rows += [[path.stem, key, value] for key, value in figures]
    emit(args.title, ["benchmark", "key", "value"], rows, {}, as_json=False)
    return 1 if unreadable else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Plain-text tables: what the launcher's plan, the slab inspector, `ctl`, `top`, the placers and
the benchmarks print, and the benchmarks' output contract (`emit`: a table for people, then with
`--json` one JSON line for scripts). A leaf module: every layer may use it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned text table; floats get 4 significant digits."""
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if math.isfinite(value) else str(value)
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the results as the last line")


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value
    return parse


#: argparse type of a benchmark's `--repeats`: a whole number from 1 to 50.
repeats_arg = whole_number(1, 50)


def emit(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]],
         result: Mapping[str, object], as_json: bool, out: TextIO | None = None) -> None:
    """Print the table under `title`, then `result` as one JSON line if `as_json`."""
    out = out or sys.stdout
    out.write(f"{title}\n{format_table(headers, rows)}\n")
    if as_json:
        out.write(json.dumps(result, sort_keys=True) + "\n")
    out.flush()

"""Plain-text tables: what the launcher's plan, the slab inspector, `ctl`, `top`, the placers and
the benchmarks print (a leaf module: every layer may use it)."""

from __future__ import annotations

import math
from collections.abc import Sequence


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

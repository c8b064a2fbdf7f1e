"""Markdown tables and matplotlib plots of sweeps, and the report file of an experiment.

A sweep is a list of `PointResult`s that differ in one parameter (its `x`: an attribute of
`PointSpec` such as "rate_scale") and in the system; tables have one row per x and a column per
system and metric, plots one line per system.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from fineslab.sim.experiments.common import PointResult
from fineslab.tables import format_table

logger = logging.getLogger(__name__)

Metric = tuple[str, Callable[[PointResult], float]]
ATTAINMENT: Metric = ("SLO attainment", lambda p: p.attainment)
TOKENS: Metric = ("tokens/s", lambda p: p.tokens_per_s)
REQUESTS: Metric = ("requests/s", lambda p: p.requests_per_s)


def _x(point: PointResult, x: str) -> float:
    return float(getattr(point.spec, x))


def systems_of(points: Sequence[PointResult]) -> list[str]:
    return list(dict.fromkeys(p.system for p in points))


def sweep_rows(points: Sequence[PointResult], x: str, metrics: Sequence[Metric],
               ) -> tuple[list[str], list[list[object]]]:
    systems = systems_of(points)
    headers = [x] + [f"{s} {name}" for name, _ in metrics for s in systems]
    rows: list[list[object]] = []
    for value in sorted({_x(p, x) for p in points}):
        at = {p.system: p for p in points if _x(p, x) == value}
        rows.append([value] + [round(fn(at[s]), 3) if s in at else "-"
                               for _, fn in metrics for s in systems])
    return headers, rows


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(points: Sequence[PointResult], x: str, metrics: Sequence[Metric]) -> str:
    headers, rows = sweep_rows(points, x, metrics)
    return format_table(headers, rows)


def plot_sweep(points: Sequence[PointResult], x: str, metrics: Sequence[Metric], path: Path,
               title: str) -> Path:
    """One subplot per metric, one line per system; written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, (name, fn) in zip(axes[0], metrics, strict=True):
        for system in systems_of(points):
            mine = sorted((p for p in points if p.system == system), key=lambda p: _x(p, x))
            ax.plot([_x(p, x) for p in mine], [fn(p) for p in mine], marker="o", label=system)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_section(title: str, points: Sequence[PointResult], x: str,
                  metrics: Sequence[Metric], out_dir: Path, stem: str) -> str:
    """A markdown section: the table and the plot of one sweep."""
    headers, rows = sweep_rows(points, x, metrics)
    plot = plot_sweep(points, x, metrics, out_dir / f"{stem}.png", title)
    unplaced = sorted({f"{p.system} at {x} {_x(p, x):g}: {_count(p.unplaced)}"
                       for p in points if p.unplaced})
    text = f"### {title}\n\n{markdown_table(headers, rows)}\n\n![{title}]({plot.name})\n"
    if unplaced:
        text += ("\nReplicas the placer could not place (a model with none placed loses all "
                 "its requests):\n")
        text += "".join(f"- {u}\n" for u in unplaced)
    return text


def _count(names: Sequence[str]) -> str:
    """"a, a, b" -> "a (2 replicas), b"."""
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(n if c == 1 else f"{n} ({c} replicas)" for n, c in counts.items())


def per_model_section(points: Sequence[PointResult], title: str) -> str:
    systems = systems_of(points)
    models = sorted({m for p in points for m in p.by_model})
    rows = [[m] + [round(next(p for p in points if p.system == s).by_model.get(m, 0.0), 3)
                   for s in systems] for m in models]
    return f"### {title}\n\n{markdown_table(['model', *systems], rows)}\n"


def write_report(out_dir: Path, name: str, body: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(body)
    logger.info("wrote %s", path)
    return path

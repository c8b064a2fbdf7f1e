"""PNG plots of a load-generator run: TTFT CDF per model, TTFT over the run's timeline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fineslab.loadgen.metrics import RequestOutcome


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(outcomes: Sequence[RequestOutcome], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for model in sorted({o.model for o in outcomes}):
        ttft = np.sort([o.ttft_s for o in outcomes if o.model == model and o.ttft_s is not None])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=model)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_timeline(outcomes: Sequence[RequestOutcome], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for model in sorted({o.model for o in outcomes}):
        mine = [o for o in outcomes if o.model == model and o.ttft_s is not None]
        ax.scatter([o.arrival_s for o in mine], [o.ttft_s for o in mine], s=6, label=model)
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("TTFT (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

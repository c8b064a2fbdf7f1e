"""Bursty groups: many models, a shifting few of them active at a time (Prism, paper 002 s.3).

Prism's production traces: 23-50% of the models are active at once, and the active set changes
54-766 times an hour. This generator draws that shape:

    periods    back to back, each of exponential length with mean `switch_mean_s` (the active
               set changes 3,600 / switch_mean_s times an hour on average)
    group      in each period a uniform random `active_fraction` of the models (at least one)
    arrivals   each active model gets a Poisson stream at `rate_per_s` during the period;
               inactive models get nothing
    lengths    rows of a ShareGPT-format length table, drawn with replacement

A pure function of its spec (seed included), like `build_workload`; request ids are unique.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineslab.errors import ConfigError
from fineslab.workload.arrivals import poisson_arrivals
from fineslab.workload.spec import Request
from fineslab.workload.traces import load_lengths


@dataclass(frozen=True)
class BurstySpec:
    models: tuple[str, ...]
    rate_per_s: float  # per active model
    active_fraction: float
    switch_mean_s: float
    duration_s: float
    lengths_path: Path
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models or len(set(self.models)) != len(self.models):
            raise ConfigError("a bursty workload needs distinct model names")
        if not 0 < self.active_fraction <= 1:
            raise ConfigError("active_fraction must be in (0, 1]")
        if min(self.rate_per_s, self.switch_mean_s, self.duration_s) <= 0:
            raise ConfigError("rate_per_s, switch_mean_s and duration_s must be positive")

    @property
    def group_size(self) -> int:
        return max(1, math.ceil(self.active_fraction * len(self.models)))


@dataclass(frozen=True)
class Period:
    start_s: float
    end_s: float
    active: tuple[str, ...]


def periods(spec: BurstySpec, rng: np.random.Generator) -> list[Period]:
    """The active groups over [0, duration_s)."""
    out, start_s = [], 0.0
    while start_s < spec.duration_s:
        end_s = min(spec.duration_s, start_s + float(rng.exponential(spec.switch_mean_s)))
        picks = rng.choice(len(spec.models), size=spec.group_size, replace=False)
        out.append(Period(start_s, end_s, tuple(spec.models[i] for i in sorted(picks))))
        start_s = end_s
    return out


def bursty_workload(spec: BurstySpec) -> tuple[list[Request], list[Period]]:
    """The requests (sorted by arrival, ties by id) and the periods that drew them."""
    rng = np.random.default_rng(spec.seed)
    table = load_lengths(spec.lengths_path, spec.max_prompt_tokens, spec.max_output_tokens)
    groups = periods(spec, rng)
    rows: list[tuple[str, float, int, int]] = []
    for period in groups:
        if period.end_s <= period.start_s:
            continue
        for model in period.active:
            times = period.start_s + poisson_arrivals(
                spec.rate_per_s, period.end_s - period.start_s, rng)
            picks = rng.integers(0, len(table), size=times.size)
            rows += [(model, float(t), int(table.prompt_tokens[p]), int(table.output_tokens[p]))
                     for t, p in zip(times, picks, strict=True)]
    rows.sort(key=lambda r: (r[1], r[0]))
    requests = [Request(f"{model}-{i:06d}", model, arrival_s, prompt, output)
                for i, (model, arrival_s, prompt, output) in enumerate(rows)]
    return requests, groups

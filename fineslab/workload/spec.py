"""A workload: which models receive requests, at what rate, with which lengths.

`build_workload(spec)` turns a `WorkloadSpec` into the list of `Request`s both the load generator
and the simulator consume, sorted by arrival, with ids unique over the run. It is a pure function
of the spec (its `seed` included): the same spec gives the same requests, byte for byte.

    poisson  each model m gets its own Poisson stream at rate_m * rate_scale; lengths are drawn
             (rows with replacement) from the length table
    replay   one Azure-format trace is compressed to the mix's total rate (or by `time_scale`)
             and each arrival is given to model m with probability rate_m / sum(rates); its
             lengths are the trace row's own
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineslab.errors import ConfigError
from fineslab.workload.arrivals import poisson_arrivals, replay_arrivals, time_scale_for_rate
from fineslab.workload.traces import load_arrival_trace, load_lengths

ARRIVAL_KINDS = ("poisson", "replay")


@dataclass(frozen=True)
class ModelLoad:
    """One model of the mix and its request rate at rate scale 1."""

    model: str
    rate_per_s: float

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0:
            raise ConfigError(f"model {self.model}: rate_per_s must be positive")


@dataclass(frozen=True)
class Request:
    request_id: str
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. `trace_path` is the length table (poisson) or the arrival trace
    (replay); `time_scale` None means "compress the trace to the mix's total rate"."""

    models: tuple[ModelLoad, ...]
    duration_s: float
    trace_path: Path
    arrival: str = "poisson"
    rate_scale: float = 1.0
    time_scale: float | None = None
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("a workload needs at least one model")
        if len({m.model for m in self.models}) != len(self.models):
            raise ConfigError("model names in a workload must be unique")
        if self.arrival not in ARRIVAL_KINDS:
            raise ConfigError(f"arrival must be one of {ARRIVAL_KINDS}, got {self.arrival!r}")
        if self.duration_s <= 0 or self.rate_scale <= 0:
            raise ConfigError("duration_s and rate_scale must be positive")

    @property
    def total_rate_per_s(self) -> float:
        return sum(m.rate_per_s for m in self.models) * self.rate_scale


def build_workload(spec: WorkloadSpec) -> list[Request]:
    """The requests of `spec`, sorted by arrival (ties by id)."""
    rng = np.random.default_rng(spec.seed)
    rows = _poisson_rows(spec, rng) if spec.arrival == "poisson" else _replay_rows(spec, rng)
    rows.sort(key=lambda r: (r[1], r[0]))
    return [Request(f"{model}-{i:06d}", model, arrival_s, prompt, output)
            for i, (model, arrival_s, prompt, output) in enumerate(rows)]


Row = tuple[str, float, int, int]


def _poisson_rows(spec: WorkloadSpec, rng: np.random.Generator) -> list[Row]:
    table = load_lengths(spec.trace_path, spec.max_prompt_tokens, spec.max_output_tokens)
    rows: list[Row] = []
    for load in spec.models:
        times = poisson_arrivals(load.rate_per_s * spec.rate_scale, spec.duration_s, rng)
        picks = rng.integers(0, len(table), size=times.size)
        rows += [(load.model, float(t), int(table.prompt_tokens[p]), int(table.output_tokens[p]))
                 for t, p in zip(times, picks, strict=True)]
    return rows


def _replay_rows(spec: WorkloadSpec, rng: np.random.Generator) -> list[Row]:
    trace = load_arrival_trace(spec.trace_path, spec.max_prompt_tokens, spec.max_output_tokens)
    scale = spec.time_scale or time_scale_for_rate(trace, spec.total_rate_per_s)
    times, picks = replay_arrivals(trace, scale, spec.duration_s)
    weights = np.array([m.rate_per_s for m in spec.models], dtype=np.float64)
    owners = rng.choice(len(spec.models), size=times.size, p=weights / weights.sum())
    lengths = trace.lengths
    return [(spec.models[o].model, float(t), int(lengths.prompt_tokens[p]),
             int(lengths.output_tokens[p]))
            for t, p, o in zip(times, picks, owners, strict=True)]


def parse_mix(text: str) -> tuple[ModelLoad, ...]:
    """`"a:1.5,b:0.5"` -> (ModelLoad("a", 1.5), ModelLoad("b", 0.5)); a bare name gets 1.0."""
    loads = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, rate = item.partition(":")
        try:
            loads.append(ModelLoad(name.strip(), float(rate) if rate else 1.0))
        except ValueError as exc:
            raise ConfigError(f"bad model mix entry {item!r}: {exc}") from exc
    if not loads:
        raise ConfigError(f"empty model mix {text!r}")
    return tuple(loads)

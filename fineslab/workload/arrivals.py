"""Arrival processes: Poisson at a rate, or an Azure trace replayed on a scaled clock.

    Poisson     inter-arrival gaps ~ Exp(rate); arrivals in [0, duration_s)
    replay      t_i' = (t_i - t_0) / time_scale, kept while t_i' < duration_s;
                time_scale > 1 compresses the trace (more requests per second)

`time_scale_for_rate` picks the compression that makes a trace's mean rate equal a target, so a
replayed run and a Poisson run carry the same average load and differ only in burstiness (the
Azure conversation trace has an inter-arrival CV of about 1.1 versus Poisson's 1.0, with
minute-scale swings of its rate).
"""

from __future__ import annotations

import numpy as np

from fineslab.errors import ConfigError
from fineslab.workload.traces import ArrivalTrace


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: np.random.Generator,
                     ) -> np.ndarray:
    """Sorted arrival times (s) of a Poisson process of `rate_per_s` over [0, duration_s)."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ConfigError(f"Poisson arrivals need a positive rate and duration, got "
                          f"{rate_per_s}/s over {duration_s} s")
    # Draw a few more gaps than the mean needs, then extend in the rare case it falls short.
    times: list[np.ndarray] = []
    now_s = 0.0
    batch = int(rate_per_s * duration_s * 1.2) + 16
    while now_s < duration_s:
        chunk = now_s + np.cumsum(rng.exponential(1.0 / rate_per_s, size=batch))
        times.append(chunk)
        now_s = float(chunk[-1])
    all_times = np.concatenate(times)
    return all_times[all_times < duration_s]


def time_scale_for_rate(trace: ArrivalTrace, target_rate_per_s: float) -> float:
    """The compression factor that makes `trace`'s mean arrival rate `target_rate_per_s`."""
    if trace.duration_s <= 0 or target_rate_per_s <= 0:
        raise ConfigError("cannot scale a trace of zero duration or to a non-positive rate")
    trace_rate_per_s = trace.arrival_s.size / trace.duration_s
    return target_rate_per_s / trace_rate_per_s


def replay_arrivals(trace: ArrivalTrace, time_scale: float, duration_s: float,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times, row indices into the trace) of the rows arriving within `duration_s`."""
    if time_scale <= 0:
        raise ConfigError(f"time_scale must be positive, got {time_scale}")
    scaled_s = (trace.arrival_s - trace.arrival_s[0]) / time_scale
    rows = np.flatnonzero(scaled_s < duration_s)
    return scaled_s[rows], rows

"""Waiting for the machine to settle before a measurement.

A probe that starts while a fleet beside it is still launching or warming up measures the
launch, not the system (issue #38: a capacity probe right after the launches, load average
10.6, refused most of its requests). `wait_settled` waits until the machine's CPUs are less
busy than a bound over a short window, up to a limit, and says what it found, so a report
can show how quiet the machine was when each figure was taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: The CPUs' share of busy time (0-1) under which the machine counts as settled.
SETTLED_BUSY = 0.5
#: The window each reading is taken over (s).
WINDOW_S = 1.0


def _cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (iowait counts as idle)."""
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def cpu_busy(window_s: float = WINDOW_S, times: Callable[[], tuple[int, int]] = _cpu_times,
             sleep: Callable[[float], None] = time.sleep) -> float:
    """The CPUs' busy share (0-1) over the next `window_s`."""
    busy0, total0 = times()
    sleep(window_s)
    busy1, total1 = times()
    return (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0


@dataclass(frozen=True)
class Settled:
    """What `wait_settled` found: the last reading, the seconds it waited, whether it settled."""

    busy: float
    waited_s: float
    settled: bool

    def figures(self) -> dict[str, float | bool]:
        return {"cpu_busy_before": round(self.busy, 3), "settle_wait_s": round(self.waited_s, 1),
                "settled": self.settled}


def wait_settled(limit_s: float, busy_below: float = SETTLED_BUSY, what: str = "a probe",
                 reading: Callable[[], float] = cpu_busy,
                 clock: Callable[[], float] = time.monotonic) -> Settled:
    """Wait until a reading is under `busy_below`, at most `limit_s` (0: one reading); a
    machine that does not settle is logged, and the measurement goes ahead."""
    start_s = clock()
    while True:
        busy = reading()
        waited_s = clock() - start_s
        if busy < busy_below:
            return Settled(busy, waited_s, True)
        if waited_s >= limit_s:
            logger.warning("the machine is still %.0f%% busy after %.0f s; %s goes ahead",
                           100 * busy, waited_s, what)
            return Settled(busy, waited_s, False)

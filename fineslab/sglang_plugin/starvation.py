"""When to hold a lone decoding request that the arena cannot feed: a policy, above the allocator.

The problem: SGLang admits a request only when its whole budget fits next to the running ones,
so with its own pool a lone running request always gets its next page. In a shared arena a
neighbour can take the free slabs in between; SGLang then finds the decode step short, retracts
down to one request, and aborts that one ("aborted last request ... due to OOM", HTTP 500).

The answer: while exactly one request decodes and the arena (not this runtime's own cap) is
short of its next page, the scheduler hook (`PluginSession.update_running_batch`) skips the
decode step, which is SGLang's own "None skips decode this step" (it does the same while
finishing requests free memory). The scheduler loop goes on: it takes new requests, the
neighbours' requests finish and give pages back, and the next iteration asks the allocator
again. Nothing sleeps; the allocator only ever says yes or no at once. SGLang's watchdog does
not fire meanwhile (it watches only iterations that run a batch).

The bound: two runtimes each starved on their last request would hold each other forever, so a
hold lasts at most `hold_s` (STARVED_HOLD_S); then the hook lets SGLang run its own path, which
aborts the request and frees its pages for the other. Cost: one reservation attempt per
scheduler iteration while held (microseconds), and the iterations themselves: SGLang's loop
polls without sleeping while a request is held, as it does while queued requests wait for memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: The longest a lone starved request is held before SGLang may abort it.
STARVED_HOLD_S = 60.0


@dataclass(frozen=True)
class DecodeShortfall:
    """What the hook saw this iteration: requests decoding, and whether the arena fed them."""

    num_running: int
    fits: bool
    within_own_cap: bool

    @property
    def starved_by_neighbours(self) -> bool:
        """One request, short of memory that this runtime's own cap would allow it."""
        return self.num_running == 1 and not self.fits and self.within_own_cap


class StarvedRequestPolicy:
    """Hold a lone request the neighbours starve, for at most `hold_s` (see the module doc)."""

    def __init__(self, hold_s: float = STARVED_HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, not {hold_s}")
        self.hold_s = hold_s
        self._clock = clock
        self._since: float | None = None

    def hold(self, shortfall: DecodeShortfall) -> bool:
        """True: skip this decode step. False: let SGLang decode, retract or abort as it does."""
        if not shortfall.starved_by_neighbours:
            if self._since is not None and shortfall.fits:
                logger.info("arena memory freed after %.2f s: decoding resumes",
                            self._clock() - self._since)
            self._since = None
            return False
        now = self._clock()
        if self._since is None:
            self._since = now
            logger.warning("the arena is full: this runtime's last running request is held "
                           "(up to %.0f s) until the neighbours free memory", self.hold_s)
        if now - self._since < self.hold_s:
            return True
        logger.error("no arena memory freed in %.0f s: SGLang aborts the request", self.hold_s)
        self._since = None
        return False

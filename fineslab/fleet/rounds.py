"""A launcher helper that runs one round every INTERVAL_S on a daemon thread of its own.

The cache reclaimer (reclaim.py) and the layer lender (lending.py) are such helpers: each
implements `run_once()`, and a round that raises is logged and the next one runs anyway (a bug
in one round must not end the helper for good).
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class Rounds:
    """`run_once()` every `interval_s`, from `start()` to `stop()`."""

    def __init__(self, name: str, interval_s: float) -> None:
        self._name, self._interval_s = name, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> object:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"fineslab-{self._name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.run_once()
            except Exception:
                logger.exception("%s round failed", self._name)

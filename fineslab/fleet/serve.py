"""Run a fleet until a signal: start it, print `ready`, serve until SIGINT or SIGTERM (or EOF on
a pipe the starter holds), then stop it whatever phase its start reached. The launcher's CLI
(`fineslab.launch.__main__`) and a cluster's node fleet (`fineslab.cluster.node_fleet`) both use
it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fineslab.errors import FatalError
from fineslab.fleet.plan import FleetPlan

if TYPE_CHECKING:
    from fineslab.fleet.machine import Fleet

logger = logging.getLogger(__name__)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def progress(message: str) -> None:
    print(message, flush=True)


def stop_with_fd(fd: int) -> None:
    """SIGTERM this process (a clean stop) once `fd` reads EOF: the process holding the pipe's
    write end is gone, however it went (a test harness or tool killed with -9)."""
    try:
        os.fstat(fd)
    except OSError:
        raise FatalError(f"--stop-with-fd {fd}: no such open file descriptor") from None

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        logger.warning("the process holding --stop-with-fd %d is gone; stopping the fleet", fd)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-fd", daemon=True).start()


def serve_until_signal(start: Callable[[], None], stop: Callable[[], None], what: str,
                       stop_fd: int | None = None) -> int:
    """`start()`, print `ready`, serve until SIGINT/SIGTERM (EOF on `stop_fd` sends SIGTERM),
    then `stop()`, whatever phase `start` reached, with further signals ignored meanwhile.
    Both signals raise KeyboardInterrupt in the main thread."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    if stop_fd is not None:
        stop_with_fd(stop_fd)
    try:
        start()
        progress("ready")
        threading.Event().wait()
    except KeyboardInterrupt:
        progress(f"stopping the {what}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop()
    return 0


def run_fleet(plan: FleetPlan, port: int | None = None, log_dir: str | None = None,
              stop_fd: int | None = None,
              on_ready: Callable[[Fleet], None] | None = None) -> int:
    """Start the fleet, serve until SIGINT/SIGTERM, stop the router, every runtime's process
    group and the arenas. `on_ready(fleet)` runs once everything serves (a cluster node
    reports its router there)."""
    from fineslab.fleet.machine import Fleet

    fleet = Fleet(plan, port, log_dir, progress)

    def start() -> None:
        fleet.start()
        if on_ready is not None:
            on_ready(fleet)

    return serve_until_signal(start, fleet.stop, "fleet", stop_fd)

"""Supervision of a fleet's runtimes: start with progress, detect death and hangs, restart with
backoff, stop all at once.

Three ways a runtime is found down, each handled by `_restart` with a reason the router passes
on to clients and to /health:

    exited   the wrapper exited, or a process of the tree died (SGLang's server notices its
             scheduler's death only after a 5 s "crash diagnostics" sleep; the tree is looked
             at every `poll_s`, so the router knows at once)
    hung     `probe_failures` liveness probes in a row failed: SGLang's own `/health_generate`
             (a 1-token generation, or any output seen while it waits) got no 200 within
             `probe_timeout_s`, AND the tree is not merely slow: a process of it is stopped
             (SIGSTOP), or the whole tree used less than `MIN_BUSY_CPU_S` of CPU since the
             first failed probe (deadlocked, wedged). A runtime whose probes time out while
             it computes (a 2-core machine loaded by restarts) is busy, not hung: the chaos
             benchmark saw such runtimes killed, and their restarts load the machine further.
    start    a restart did not come up healthy

A restart never gives up: the n-th restart in a row waits `backoff_s(n)` (0, then 1, 2, 4 ...
up to `backoff_max_s`); a runtime that served for `stable_after_s` starts again from 0. The
router is told how long until the runtime is expected back (the wait plus its last start-up
time), so a request that cannot wait that long is refused at once, with a Retry-After that
says how long.

Lock order: `_lock` only (held while the process table changes, never while waiting).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

from fineslab.errors import EnvironmentSetupError
from fineslab.fleet.config import SupervisionPolicy
from fineslab.fleet.plan import RuntimePlan
from fineslab.runtime import PortInUse, ServerProcess, ServerSpec, free_port
from fineslab.zygote import dead_zygotes, revive_dead_zygotes

logger = logging.getLogger(__name__)

#: Fresh ports tried for a runtime whose port was taken during its start-up.
PORT_RETRIES = 3

#: SIGTERM to SIGKILL when the fleet stops. Short on purpose: the router has stopped first, so
#: nothing is in flight, and SGLang 0.5.23 answers SIGTERM with a 3 s drain and, once it sees
#: its scheduler gone, a 5 s "crash diagnostics" sleep; its shm files are removed either way.
STOP_GRACE_S = 1.0

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")

#: How often a runtime still starting is reported (with why, where the fleet can tell).
SLOW_START_S = 30.0

#: How long a runtime that waits for memory (neither answering nor computing) is starved,
#: not hung; after that it is restarted like a hung one.
STARVED_MAX_S = 300.0

#: CPU a tree must use between its first and last failed probe to count as busy, not hung.
MIN_BUSY_CPU_S = 0.5


@dataclass
class SupervisedRuntime:
    plan: RuntimePlan
    spec: ServerSpec
    log_path: Path
    process: ServerProcess | None = None
    restarts: int = 0
    restarting: bool = field(default=False)
    consecutive: int = 0  # restarts in a row without `stable_after_s` of serving between
    up_since_s: float | None = None
    start_s: float = 60.0  # how long its last start-up took (the restart ETA)


class Supervisor:
    """Starts, watches, restarts and stops the runtimes of a fleet."""

    def __init__(self, runtimes: list[SupervisedRuntime], *,
                 on_down: Callable[[str, str, float], None],
                 on_up: Callable[[str, int, str], None],
                 reclaim: Callable[[str], list[str]], progress: Callable[[str], None],
                 policy: SupervisionPolicy | None = None, poll_s: float = 0.5,
                 before_start: Callable[[RuntimePlan], None] = lambda plan: None,
                 slow_start: Callable[[RuntimePlan, float], None] = lambda plan, s: None,
                 starved: Callable[[RuntimePlan], str | None] = lambda plan: None) -> None:
        """`before_start(plan)` runs before each restart (the fleet makes room there for a
        runtime whose weights live in the arena); `slow_start(plan, seconds)` every
        SLOW_START_S a runtime takes to come up (the fleet says why and acts there);
        `starved(plan)` says why a runtime that neither answers nor computes waits for memory
        (None: it does not), which makes it starved, not hung, for up to STARVED_MAX_S."""
        self.runtimes = {r.plan.runtime_id: r for r in runtimes}
        self.on_down, self.on_up, self.reclaim = on_down, on_up, reclaim
        self.before_start = before_start
        self.slow_start = slow_start
        self.starved = starved
        self.progress = progress
        self.policy = policy or SupervisionPolicy()
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._started = 0  # runtimes start_all brought up (for its progress lines)
        #: Runtimes asleep (elastic models): paused, so they are not probed (a probe generates).
        self._asleep: set[str] = set()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []  # restarts, joined at stop
        self._watchers: list[threading.Thread] = []  # watch and probe loops, daemons

    # -- start ----------------------------------------------------------------------------------

    def start_all(self, only: Collection[str] | None = None) -> None:
        """Start every runtime (or those in `only`) at once, then wait for each to be healthy,
        reporting progress."""
        wave = [r for r in self.runtimes.values()
                if (only is None or r.plan.runtime_id in only) and r.process is None]
        with self._lock:
            for r in wave:
                r.process = ServerProcess(r.spec, r.log_path)
        start_s = time.monotonic()
        for r in wave:
            self._started += 1
            i = self._started
            try:
                self._wait_healthy(r)
            except EnvironmentSetupError as exc:
                raise EnvironmentSetupError(
                    f"runtime {r.plan.runtime_id} did not start (log: {r.log_path}): {exc}"
                ) from exc
            r.start_s = time.monotonic() - start_s
            r.up_since_s = time.monotonic()
            self.progress(f"[{i}/{len(self.runtimes)}] runtime {r.plan.runtime_id} healthy on "
                          f"{r.spec.base_url} after {r.start_s:.0f} s")

    def _wait_healthy(self, r: SupervisedRuntime) -> None:
        """Wait for `r`'s process; start it again on a fresh port while its port was taken."""
        for attempt in range(PORT_RETRIES + 1):
            assert r.process is not None
            try:
                r.process.wait_healthy(self.policy.health_timeout_s,
                                       lambda waited_s: self.slow_start(r.plan, waited_s),
                                       SLOW_START_S)
                return
            except PortInUse:
                if attempt == PORT_RETRIES or self._stopping.is_set():
                    raise
            r.process.stop(grace_s=5)
            log_path = r.process.log_path or r.log_path
            old_port = r.spec.port
            with self._lock:
                r.spec = replace(r.spec, port=free_port(r.spec.host))
                r.process = ServerProcess(r.spec, log_path.with_suffix(f".port{attempt + 1}.log"))
            self.progress(f"runtime {r.plan.runtime_id}: port {old_port} was taken during "
                          f"start-up; started it again on port {r.spec.port}")

    def set_asleep(self, runtime_id: str, asleep: bool) -> None:
        """An elastic model's runtime sleeps (not probed; its process is still watched) or
        wakes."""
        with self._lock:
            (self._asleep.add if asleep else self._asleep.discard)(runtime_id)

    def pid_of(self, runtime_id: str) -> int | None:
        process = self.runtimes[runtime_id].process
        return process.proc.pid if process is not None else None

    # -- watch, probe and restart ---------------------------------------------------------------

    def watch(self) -> None:
        self._spawn(self._watchers, self._watch_loop, "fineslab-supervisor")
        for r in self.runtimes.values():
            self._spawn(self._watchers, self._probe_loop, f"fineslab-probe-{r.plan.runtime_id}",
                        r)

    @staticmethod
    def _spawn(into: list[threading.Thread], target: Callable[..., None], name: str,
               *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        into.append(thread)
        thread.start()

    def _watch_loop(self) -> None:
        reviver: threading.Thread | None = None
        while not self._stopping.wait(self.poll_s):
            if (reviver is None or not reviver.is_alive()) and dead_zygotes():
                # The zygote is supervised too: a dead one is replaced at once, in the
                # background (an import), so the next restart is warm (fineslab.zygote).
                reviver = threading.Thread(target=revive_dead_zygotes, daemon=True,
                                           name="fineslab-zygote-revive")
                reviver.start()
            for r in list(self.runtimes.values()):
                if r.restarting or r.process is None:
                    continue
                code = r.process.proc.poll()
                if code is not None:
                    self._down(r, f"exited with {code}")
                elif not r.process.tree_intact():
                    lost = ", ".join(r.process.lost_members())
                    self._down(r, f"a process of its tree died: {lost or 'one'}")

    def _probe_loop(self, r: SupervisedRuntime) -> None:
        failures, cpu_at_first = 0, dict[int, int]()
        starved_since: float | None = None
        while not self._stopping.wait(self.policy.probe_interval_s):
            process = r.process
            if r.restarting or process is None or r.plan.runtime_id in self._asleep:
                failures = 0
                continue
            if self._probe(process.spec.base_url):
                failures, starved_since = 0, None
                continue
            failures += 1
            cpu_at_first = process.cpu_ticks() if failures == 1 else cpu_at_first
            logger.warning("runtime %s failed liveness probe %d of %d", r.plan.runtime_id,
                           failures, self.policy.probe_failures)
            if failures < self.policy.probe_failures or process is not r.process:
                continue
            # Per process: one that died meanwhile adds nothing (the watcher handles deaths).
            busy_s = sum(max(0, ticks - cpu_at_first.get(pid, ticks))
                         for pid, ticks in process.cpu_ticks().items()) / CLOCK_TICKS_PER_S
            waits_for = None if process.stopped() else self.starved(r.plan)
            if waits_for is not None and busy_s < MIN_BUSY_CPU_S:
                starved_since = starved_since or time.monotonic()
                if time.monotonic() - starved_since < STARVED_MAX_S:
                    # Its probe's one token waits for KV the neighbours hold (the chaos
                    # benchmark on a loaded machine killed such a runtime as hung).
                    logger.warning("runtime %s: no answer to %d probes while it waits for "
                                   "memory (%s): starved, not hung", r.plan.runtime_id,
                                   failures, waits_for)
                    failures = 0
                    continue
            if process.stopped():
                why = "a process of it is stopped"
            elif busy_s < MIN_BUSY_CPU_S:
                why = f"it used {busy_s:.2f} s of CPU meanwhile" + (
                    f" and waited for memory for {STARVED_MAX_S:.0f} s" if waits_for else "")
            else:
                logger.warning("runtime %s: no answer to %d probes, but it used %.1f s of CPU "
                               "meanwhile: busy, not hung", r.plan.runtime_id, failures, busy_s)
                failures = 0
                continue
            failures, starved_since = 0, None
            self._down(r, f"hung: no answer to {self.policy.probe_failures} health probes "
                          f"of {self.policy.probe_timeout_s:g} s, and {why}")

    def _probe(self, base_url: str) -> bool:
        try:
            with urllib.request.urlopen(base_url + "/health_generate",
                                        timeout=self.policy.probe_timeout_s) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _down(self, r: SupervisedRuntime, reason: str) -> None:
        with self._lock:
            if r.restarting or self._stopping.is_set():
                return
            r.restarting = True
        assert r.process is not None
        stable = r.up_since_s is not None and (
            time.monotonic() - r.up_since_s >= self.policy.stable_after_s)
        r.consecutive = 0 if stable else r.consecutive
        wait_s = self.policy.backoff_s(r.consecutive)
        logger.error("runtime %s (process group %d) is down: %s; log: %s", r.plan.runtime_id,
                     r.process.proc.pid, reason, r.log_path)
        self.on_down(r.plan.runtime_id, reason, wait_s + r.start_s)
        self._spawn(self._threads, self._restart, f"fineslab-restart-{r.plan.runtime_id}", r,
                    reason, wait_s)

    def _restart(self, r: SupervisedRuntime, reason: str, wait_s: float) -> None:
        assert r.process is not None
        r.process.stop(grace_s=STOP_GRACE_S)
        reclaimed = self.reclaim(r.plan.device.name)
        if reclaimed:
            self.progress(f"reclaimed the slabs of {reclaimed}")
        r.restarts += 1
        r.consecutive += 1
        self.progress(f"restarting runtime {r.plan.runtime_id} (restart {r.restarts}"
                      + (f", in {wait_s:.0f} s" if wait_s else "") + f"): {reason}")
        if self._stopping.wait(wait_s):
            return
        self.before_start(r.plan)
        start_s = time.monotonic()
        with self._lock:
            if self._stopping.is_set():
                return
            r.process = ServerProcess(r.spec, r.log_path.with_suffix(f".{r.restarts}.log"))
        try:
            self._wait_healthy(r)
        except EnvironmentSetupError as exc:
            logger.error("restart of %s failed: %s", r.plan.runtime_id, exc)
            r.restarting = False  # the watcher sees the exit and tries again, later
            return
        r.start_s, r.up_since_s = time.monotonic() - start_s, time.monotonic()
        r.restarting = False
        self.on_up(r.plan.runtime_id, r.process.proc.pid, r.spec.base_url)
        self.progress(f"runtime {r.plan.runtime_id} is back on {r.spec.base_url} after "
                      f"{r.start_s:.0f} s")

    # -- stop -----------------------------------------------------------------------------------

    def stop_all(self) -> None:
        """Stop watching, then stop every runtime's process group at once (no orphan is left,
        nor SGLang shm file), reporting each as it goes."""
        self._stopping.set()
        with self._lock:
            running = [(rid, r.process) for rid, r in self.runtimes.items()
                       if r.process is not None]
        start_s = time.monotonic()
        if running:
            self.progress(f"stopping {len(running)} runtime(s)")
        done = itertools.count(1)

        def stop_one(runtime_id: str, process: ServerProcess) -> None:
            process.stop(grace_s=STOP_GRACE_S)
            self.progress(f"[{next(done)}/{len(running)}] runtime {runtime_id} stopped "
                          f"after {time.monotonic() - start_s:.1f} s")

        stoppers = [threading.Thread(target=stop_one, args=item, daemon=True,
                                     name=f"fineslab-stop-{item[0]}") for item in running]
        for thread in stoppers:
            thread.start()
        for thread in [*stoppers, *self._threads]:
            thread.join(timeout=30)
        with self._lock:  # a restart that raced the stop
            for r in self.runtimes.values():
                if r.process is not None and r.process.tree_pids():
                    r.process.stop(grace_s=STOP_GRACE_S)

"""SGLang runtimes of a fleet: their command lines, start-up with progress, and supervision.

`server_spec(plan, prepared)` turns a `RuntimePlan` and its model's prepared checkpoint
(`fineslab.quant.fleet.PrecisionRuntime`) into the SGLang server: the served name is the
model's name in the fleet (the OpenAI `model` field), the page size is the arena block's
tokens, the precision's arguments (`--dtype`, `--quantization`, `--kv-cache-dtype`, ...) come
from the prepared checkpoint, and the environment carries the plugin's join request
(`FINESLAB_ARENA=<fleet_id>`, `FINESLAB_RUNTIME_ID=<runtime id>`), the quantized KV format
(`FINESLAB_KV_FORMAT`, `FINESLAB_KV_SCALES`) and the model's `env`. This is the one way
fineslab starts a runtime of any precision.

`Supervisor` owns the processes. Its watcher thread polls them every `poll_s`; when one has
exited it (1) tells the router (`on_down`: in-flight requests of that runtime fail at once),
(2) stops what is left of the process group, (3) reclaims the dead runtime's slabs in the slab
table, (4) starts it again on the same port and, once healthy, tells the router (`on_up`, with
the runtime's URL). A runtime that keeps dying is given up after `max_restarts`.

A runtime that exits at start-up because its port was taken (`PortInUse`: another process bound
it between `free_port` and the server's bind, which comes only after model loading) is started
again at once on a fresh port, up to `PORT_RETRIES` times; this does not count as a restart.

Lock order: `_lock` only (held while the process table changes, never while waiting for health).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from fineslab.errors import EnvironmentSetupError
from fineslab.launch.leftovers import FLEET_MARKER
from fineslab.launch.plan import RuntimePlan, prefill_chunk_args
from fineslab.quant.fleet import PrecisionRuntime
from fineslab.runtime import PortInUse, ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin import ArenaJoin

logger = logging.getLogger(__name__)

#: Fresh ports tried for a runtime whose port was taken during its start-up.
PORT_RETRIES = 3

#: SIGTERM to SIGKILL when the fleet stops. Short on purpose: the router has stopped first, so
#: nothing is in flight, and SGLang 0.5.23 answers SIGTERM with a 3 s drain and, once it sees
#: its scheduler gone, a 5 s "crash diagnostics" sleep; its shm files are removed either way.
STOP_GRACE_S = 1.0

#: KV tokens for a runtime on SGLang's own pool (no arena to size it): enough for the demo.
OWN_POOL_MAX_TOTAL_TOKENS = 16384


def server_spec(plan: RuntimePlan, prepared: PrecisionRuntime, fleet_id: str, use_arena: bool,
                port: int | None = None, max_running_requests: int | None = None) -> ServerSpec:
    """The SGLang server for one runtime of the plan (see the module docstring)."""
    model = plan.model
    args = ["--served-model-name", model.name, *prepared.server_args]
    if prepared.kv_env and not use_arena:
        raise EnvironmentSetupError(f"runtime {plan.runtime_id}: {prepared.kv_dtype.value} KV "
                                    "is stored only in the slab arena (kv_pool: arena)")
    if use_arena:
        if plan.page_size is None:
            raise EnvironmentSetupError(f"runtime {plan.runtime_id}: no arena page size planned")
        args += ["--page-size", str(plan.page_size),
                 *prefill_chunk_args(plan.runtime_id, plan.page_size, model.extra_args)]
    else:
        args += ["--max-total-tokens", str(OWN_POOL_MAX_TOTAL_TOKENS)]
    running = model.max_running_requests or max_running_requests
    if running is not None:
        args += ["--max-running-requests", str(running)]
    cpu = plan.device.is_cpu
    if not cpu:
        args += ["--base-gpu-id", plan.device.name.split(":")[1]]
    env = {**dict(model.env), FLEET_MARKER: fleet_id}
    if use_arena:
        env.update(ArenaJoin(fleet_id, plan.runtime_id, plan.key_pool).environ(),
                   **prepared.kv_env)
    return ServerSpec(str(prepared.model_path), port or free_port(), cpu=cpu,
                      extra_args=(*args, *model.extra_args), env=env)


@dataclass
class SupervisedRuntime:
    plan: RuntimePlan
    spec: ServerSpec
    log_path: Path
    process: ServerProcess | None = None
    restarts: int = 0
    restarting: bool = field(default=False)
    given_up: bool = field(default=False)


class Supervisor:
    """Starts, watches, restarts and stops the runtimes of a fleet."""

    def __init__(self, runtimes: list[SupervisedRuntime], *,
                 on_down: Callable[[str], None], on_up: Callable[[str, int, str], None],
                 reclaim: Callable[[str], list[str]], progress: Callable[[str], None],
                 health_timeout_s: float = 600.0, poll_s: float = 0.5,
                 max_restarts: int = 5) -> None:
        self.runtimes = {r.plan.runtime_id: r for r in runtimes}
        self.on_down, self.on_up, self.reclaim = on_down, on_up, reclaim
        self.progress = progress
        self.health_timeout_s, self.poll_s, self.max_restarts = (
            health_timeout_s, poll_s, max_restarts)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- start ----------------------------------------------------------------------------------

    def start_all(self) -> None:
        """Start every runtime at once, then wait for each to be healthy, reporting progress."""
        with self._lock:
            for r in self.runtimes.values():
                r.process = ServerProcess(r.spec, r.log_path)
        start_s = time.monotonic()
        for i, r in enumerate(self.runtimes.values(), start=1):
            try:
                self._wait_healthy(r)
            except EnvironmentSetupError as exc:
                raise EnvironmentSetupError(
                    f"runtime {r.plan.runtime_id} did not start (log: {r.log_path}): {exc}"
                ) from exc
            self.progress(f"[{i}/{len(self.runtimes)}] runtime {r.plan.runtime_id} healthy on "
                          f"{r.spec.base_url} after {time.monotonic() - start_s:.0f} s")

    def _wait_healthy(self, r: SupervisedRuntime) -> None:
        """Wait for `r`'s process; start it again on a fresh port while its port was taken."""
        for attempt in range(PORT_RETRIES + 1):
            assert r.process is not None
            try:
                r.process.wait_healthy(self.health_timeout_s)
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

    def pid_of(self, runtime_id: str) -> int | None:
        process = self.runtimes[runtime_id].process
        return process.proc.pid if process is not None else None

    # -- watch and restart ----------------------------------------------------------------------

    def watch(self) -> None:
        thread = threading.Thread(target=self._watch_loop, name="fineslab-supervisor",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()

    def _watch_loop(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for r in list(self.runtimes.values()):
                if r.restarting or r.given_up or r.process is None:
                    continue
                if r.process.proc.poll() is not None:
                    self._on_exit(r)

    def _on_exit(self, r: SupervisedRuntime) -> None:
        assert r.process is not None
        code = r.process.proc.returncode
        logger.error("runtime %s (pid %d) exited with %s; log: %s", r.plan.runtime_id,
                     r.process.proc.pid, code, r.log_path)
        self.on_down(r.plan.runtime_id)
        r.restarting = True
        thread = threading.Thread(target=self._restart, args=(r,), daemon=True,
                                  name=f"fineslab-restart-{r.plan.runtime_id}")
        self._threads.append(thread)
        thread.start()

    def _restart(self, r: SupervisedRuntime) -> None:
        assert r.process is not None
        r.process.stop(grace_s=5)
        reclaimed = self.reclaim(r.plan.device.name)
        if reclaimed:
            self.progress(f"reclaimed the slabs of {reclaimed}")
        if r.restarts >= self.max_restarts:
            r.given_up, r.restarting = True, False
            self.progress(f"runtime {r.plan.runtime_id} died {r.restarts + 1} times; giving up")
            return
        with self._lock:
            if self._stopping.is_set():
                return
            r.restarts += 1
            self.progress(f"restarting runtime {r.plan.runtime_id} (restart {r.restarts})")
            r.process = ServerProcess(r.spec, r.log_path.with_suffix(f".{r.restarts}.log"))
        try:
            self._wait_healthy(r)
        except EnvironmentSetupError as exc:
            logger.error("restart of %s failed: %s", r.plan.runtime_id, exc)
            r.restarting = False  # the watcher sees the exit and tries again
            return
        r.restarting = False
        self.on_up(r.plan.runtime_id, r.process.proc.pid, r.spec.base_url)
        self.progress(f"runtime {r.plan.runtime_id} is back on {r.spec.base_url}")

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

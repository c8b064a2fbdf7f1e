"""Start, health-check and stop one SGLang server process (`python -m sglang.launch_server`).

An SGLang server is a process tree (the HTTP server, a scheduler per TP rank, a detokenizer).
`ServerProcess` starts it through the lifeline wrapper (`fineslab.lifeline`) as the leader of a
new session, so that:

- stopping it reaches the whole tree: SIGTERM to the process group, then SIGKILL to whatever is
  left after a grace period (tests check `ServerProcess.tree_pids()` is empty after `stop()`);
- the tree dies with the process that started it, even when that one is killed with SIGKILL
  (the wrapper watches a pipe only this process writes to);
- SGLang's shared-memory files of the tree (`fineslab.proctree`) are removed on stop,
  whichever way its processes ended.

`proc` is the wrapper (pid == the process group id); it exits with the server's status.

Starts are warm by default: both processes are forks of this process's zygote
(`fineslab.zygote`, SGLang imported once), told everything after the fork, so the tree looks
and behaves as a plain start's (same command lines, group, log, lifeline). Where a warm start
cannot be had (`FINESLAB_ZYGOTE=0`, CUDA initialised, no zygote), the start is plain and
the log says why; a warm start that exits during start-up is
started again plainly. `start_kind` says which it was.

In CPU mode the child gets the CPU stand-ins on its path and SGLang's CPU flags
(`fineslab.cpu_mode`).

SGLang's crash diagnostics are off unless asked for (`QUIET_EXIT`): when its scheduler exits on
a signal, which every stop here is, the server sleeps 5 s and then runs py-spy and CUDA core
dumps, so each stop took over 5 s. Set either variable to 1 in the environment or a model's
`env` to have them back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fineslab import cpu_mode, startlog
from fineslab.env import SHARED_ZYGOTE_VAR, FineslabEnv
from fineslab.errors import EnvironmentSetupError
from fineslab.proctree import (
    FLEET_MARKER,
    alive_in_group,
    descendant_pids,
    process_name,
    remove_files,
    stat_fields,
    stop_group,
    tree_pids_of_group,
    tree_shm_files,
)
from fineslab.zygote import (
    ForkedProcess,
    Zygote,
    ZygoteAbandoned,
    ZygoteUnavailable,
    serve_zygote,
    shared_zygote,
)
from fineslab.zygote.protocol import ForkRequest

logger = logging.getLogger(__name__)


#: fineslab hands out ports from this band: below SGLang's own band (22000-29999, where it picks
#: its torch-distributed port) and below the kernel's ephemeral range (32768+ by default, where
#: bind(0) and every outgoing connection take theirs). A port picked here and bound only later,
#: after a server's start-up, cannot be taken meanwhile by an outgoing connection or by another
#: runtime's internal port, which is what happened with bind(0) ports.
PORT_BAND = (10000, 21999)

_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after).

    Drawn at random from `PORT_BAND` (capped below the ephemeral range), never twice from one
    process; bind(0) only when the band is exhausted.
    """
    low, high = PORT_BAND[0], min(PORT_BAND[1], _ephemeral_low() - 1)
    candidates = [p for p in range(low, high + 1) if p not in _handed_out]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class PortInUse(EnvironmentSetupError):
    """The server exited at start-up because its port was taken (pick another and retry)."""


@dataclass(frozen=True)
class ServerSpec:
    """What to run: a model directory and the SGLang server arguments beyond the CPU defaults."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    cpu: bool = True
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        # On CPU, through `fineslab.cpu_mode.forked`: the scheduler and detokenizer forked,
        # not spawned (two imports of SGLang fewer per start); the command line still names
        # sglang.launch_server.
        module = ["-m", "fineslab.cpu_mode.forked"] if self.cpu else ["-m"]
        argv = [
            sys.executable, *module, "sglang.launch_server",
            "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
        ]
        if self.cpu:
            argv += cpu_mode.cpu_server_argv()
        return argv + list(self.extra_args)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


_lifeline: tuple[int, int] | None = None


def lifeline_read_fd() -> int:
    """The read end of this process's lifeline pipe (created once; its write end is never
    written to nor closed, so readers see EOF exactly when this process is gone)."""
    global _lifeline
    if _lifeline is None:
        _lifeline = os.pipe()  # both ends non-inheritable; pass_fds hands the read end over
    return _lifeline[0]


# SGLang's own defaults are 1 (sglang/srt/environ.py); the environment and the spec override these.
QUIET_EXIT = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def _base_environ(cpu: bool) -> dict[str, str]:
    """What every runtime's environment starts from (its spec's `env` goes on top)."""
    base = {**QUIET_EXIT, **os.environ}
    return cpu_mode.child_environ(base) if cpu else base


def prestart_zygote(cpu: bool = True, fleet_id: str | None = None,
                    env: Mapping[str, str] | None = None) -> Zygote | None:
    """Start this process's zygote now (the first warm start would otherwise pay its import),
    for a launcher to overlap with its planning and a benchmark to keep out of its timings;
    `fleet_id`: the fleet whose runtimes it forks (its marker shows in their environment);
    `env`: what every runtime's spec adds to the environment alike (the zygote imports with
    it); None (logged) where warm starts are off or the zygote cannot start."""
    if not FineslabEnv.from_environ().warm_starts:
        return None
    try:
        marker = {FLEET_MARKER: fleet_id} if fleet_id else {}
        return shared_zygote(cpu, {**_base_environ(cpu), **(env or {}), **marker},
                             lifeline_read_fd())
    except ZygoteAbandoned:
        return None  # its launcher is stopping
    except ZygoteUnavailable as exc:
        logger.warning("no zygote: runtimes start plainly (%s)", exc)
        return None


def serve_zygote_to_children(cpu: bool = True) -> Zygote | None:
    """Start a zygote that this process's runtimes and its children's (launchers, node fleets,
    benchmarks it starts) fork from, instead of each launcher importing SGLang for a zygote of
    its own: `FINESLAB_SHARED_ZYGOTE` is set to its socket in this process's environment. A
    runtime whose environment it cannot take (another variable a module reads at import) still
    gets its launcher's own. It dies with this process; `stop()` it when done (and unset the
    variable). None (logged) where warm starts are off or it cannot start."""
    if not FineslabEnv.from_environ().warm_starts:
        return None
    try:
        zygote = serve_zygote(_base_environ(cpu), lifeline_read_fd())
    except ZygoteUnavailable as exc:
        logger.warning("no zygote to share: each launcher starts its own (%s)", exc)
        return None
    os.environ[SHARED_ZYGOTE_VAR] = str(zygote.socket_path)
    return zygote


class ServerProcess:
    """A running SGLang server; use as a context manager or call `stop()`."""

    def __init__(self, spec: ServerSpec, log_path: Path | None = None,
                 warm: bool = True) -> None:
        self.spec = spec
        base = _base_environ(spec.cpu)
        self.env = {**base, **spec.env}
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.shm_files: set[Path] = set()
        self.members: set[int] = set()  # the tree's processes once healthy (tree_intact)
        self._member_names: dict[int, str] = {}
        self.proc: subprocess.Popen[bytes] | ForkedProcess
        #: How this server was started: "warm" (forked from the zygote) or "plain".
        self.start_kind = "plain"
        #: The zygote this server was forked from (None: a plain start).
        self.zygote: Zygote | None = None
        self.stopping = False  # set by stop(): an exit then is no failed start to retry
        logger.info("starting SGLang server: %s", " ".join(spec.argv()))
        self._begun_s = time.monotonic()
        if warm and FineslabEnv.from_environ().warm_starts:
            try:
                self.proc = self._fork()
                self.start_kind = "warm"
            except ZygoteUnavailable as exc:
                logger.warning("starting %s plainly: %s", spec.model_path, exc)
        if self.start_kind == "plain":
            self.proc = self._popen()
        startlog.record("begin", "sglang-server", self.start_kind, detail=spec.model_path)

    def _lifeline_argv(self) -> list[str]:
        return [sys.executable, "-m", "fineslab.lifeline", "--fd", str(lifeline_read_fd()),
                "--", *self.spec.argv()]

    def _popen(self) -> subprocess.Popen[bytes]:
        fd = lifeline_read_fd()
        return subprocess.Popen(self._lifeline_argv(), env=self.env, stdout=self._log,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(fd,))

    def _fork(self) -> ForkedProcess:
        """A warm start: this server forked from this process's zygote (fineslab.zygote)."""
        argv = self.spec.argv()
        module_at = argv.index("sglang.launch_server")
        zygote = self.zygote = shared_zygote(self.spec.cpu, self.env, lifeline_read_fd())
        request = ForkRequest(
            module="sglang.launch_server", args=argv[module_at + 1:], env=self.env,
            cwd=os.getcwd(), title=argv, wrapper_title=self._lifeline_argv(),
            fork_children=self.spec.cpu)
        if self._log is subprocess.DEVNULL:
            with open(os.devnull, "wb") as devnull:
                return zygote.fork(request, devnull.fileno())
        return zygote.fork(request, self._log.fileno())  # type: ignore[union-attr]

    def _start_plainly_after(self, reason: str) -> None:
        """A warm start failed: stop what is left of it and start the same server plainly."""
        logger.warning("SGLang server %s %s during a warm start; starting it plainly",
                       self.spec.model_path, reason)
        stop_group(self.proc.pid, 2.0, reap=self.proc.poll)
        self.proc, self.zygote = self._popen(), None
        self.start_kind = "plain-after-warm"
        startlog.record("begin", "sglang-server", self.start_kind, detail=self.spec.model_path)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float = 180.0,
                     still_waiting: Callable[[float], None] | None = None,
                     every_s: float = 30.0) -> None:
        """Block until `/health` answers 200; raise with the log's tail if the server dies.
        `still_waiting(seconds)` is called every `every_s` seconds it waits.

        Raises `PortInUse` as soon as the log shows that the server could not bind its port:
        SGLang 0.5.23 does not exit then (its HTTP server stops, its scheduler keeps running).
        """
        begun = time.monotonic()
        deadline = begun + timeout_s
        next_report = begun + every_s
        while time.monotonic() < deadline:
            if still_waiting is not None and time.monotonic() >= next_report:
                still_waiting(time.monotonic() - begun)
                next_report += every_s
            if self.port_taken():
                raise PortInUse(f"port {self.spec.port} was taken before the SGLang server "
                                "could bind it.\n" + self.log_tail())
            if self.proc.poll() is not None and self.stopping:
                raise EnvironmentSetupError("SGLang server stopped during start-up")
            if self.proc.poll() is not None and self.start_kind == "warm" \
                    and not self.refused_by_fineslab():
                self._start_plainly_after(f"exited with code {self.proc.returncode}")
                continue
            if self.proc.poll() is not None:
                raise EnvironmentSetupError(
                    f"SGLang server exited with code {self.proc.returncode} during start-up.\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.spec.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.record_shm()
                        self.members = set(self.tree_pids())
                        self._member_names = {pid: process_name(pid) for pid in self.members}
                        startlog.record("ready", "sglang-server", self.start_kind,
                                        time.monotonic() - self._begun_s, self.spec.model_path)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise EnvironmentSetupError(
            f"SGLang server not healthy after {timeout_s:.0f} s.\n" + self.log_tail()
        )

    def refused_by_fineslab(self) -> bool:
        """Whether the log's end shows one of fineslab's own errors (a configuration the plugin
        refuses, an arena without room): the server's answer to what it was told, which a plain
        start would give again (a bad configuration cost two starts)."""
        return "fineslab.errors." in self.log_tail(200)

    def port_taken(self) -> bool:
        """Whether the log's end says the server could not bind its port (asyncio's Errno 98
        message, which uvicorn logs)."""
        if self.log_path is None:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                tail = f.read().decode(errors="replace").lower()
        except OSError:
            return False
        return f"{self.spec.port}): address already in use" in tail

    def log_tail(self, num_lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def tree_pids(self) -> list[int]:
        """PIDs of live processes in the server's process group (empty once fully stopped)."""
        return tree_pids_of_group(self.proc.pid)

    def tree_intact(self) -> bool:
        """Whether every process the tree had when it became healthy is still alive (SGLang's
        server notices a dead scheduler only after a 5 s sleep; this sees it at once)."""
        return not self.members - alive_in_group(self.members, self.proc.pid)

    def lost_members(self) -> list[str]:
        """The processes of the healthy tree that are gone, as `name (pid N)`: which of SGLang's
        processes died, for the log."""
        gone = self.members - alive_in_group(self.members, self.proc.pid)
        return [f"{self._member_names.get(pid) or 'process'} (pid {pid})" for pid in sorted(gone)]

    def cpu_ticks(self) -> dict[int, int]:
        """CPU time (clock ticks, user + system) each live process of the tree has used."""
        ticks = {pid: stat_fields(pid) for pid in self.tree_pids()}
        return {pid: int(f[11]) + int(f[12]) for pid, f in ticks.items() if len(f) > 12}

    def stopped(self) -> bool:
        """Whether a process of the tree is stopped (SIGSTOP, a debugger)."""
        return any(stat_fields(pid)[:1] in (["T"], ["t"]) for pid in self.tree_pids())

    def record_shm(self) -> None:
        """Note the SGLang shm files the live tree uses, to remove them after it is gone."""
        self.shm_files |= tree_shm_files(self.tree_pids())

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, wait up to `grace_s`, then SIGKILL what is left; then
        remove the tree's SGLang shm files."""
        self.stopping = True
        pgid = self.proc.pid
        self.record_shm()
        if self.proc.poll() is None or tree_pids_of_group(pgid):
            stop_group(pgid, grace_s, reap=self.proc.poll)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("SGLang server %d did not exit after SIGKILL", pgid)
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]
        if not tree_pids_of_group(pgid):
            removed = remove_files(self.shm_files)
            if removed:
                logger.info("removed %d SGLang shm file(s) of server %d", len(removed), pgid)


def start_server(spec: ServerSpec, log_path: Path | None = None,
                 timeout_s: float = 180.0, port_retries: int = 3) -> ServerProcess:
    """Start a server and wait until it is healthy; stop it again if it never gets there.

    A port taken during start-up is replaced by a fresh one (up to `port_retries` times), so
    read the URL from the returned server's `spec`, not from `spec`.
    """
    for attempt in range(port_retries + 1):
        server = ServerProcess(spec, log_path)
        try:
            server.wait_healthy(timeout_s)
            return server
        except PortInUse:
            server.stop()
            if attempt == port_retries:
                raise
            logger.warning("port %d was taken during start-up; retrying", spec.port)
            spec = dataclasses.replace(spec, port=free_port(spec.host))
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def wait_until_up(proc: subprocess.Popen[bytes], health_url: str, what: str,
                  timeout_s: float, poll_s: float = 0.05) -> None:
    """Block until `health_url` answers, for a plain child process (not an SGLang server).

    Raises EnvironmentSetupError, killing `proc`, if it exits or does not come up in time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvironmentSetupError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(health_url, timeout=1):
                return
        except OSError:
            time.sleep(poll_s)
    proc.kill()
    raise EnvironmentSetupError(f"{what} not up at {health_url} after {timeout_s} s")


def start_engine(**kwargs: object) -> Any:
    """`sglang.Engine(**kwargs)`, counted (fineslab.startlog): the one way fineslab and its
    tests start an in-process engine."""
    import sglang

    started = time.monotonic()
    startlog.record("begin", "sglang-engine", "in-process", detail=str(kwargs.get("model_path")))
    before = dict(os.environ)
    engine = sglang.Engine(**kwargs)
    _engine_environ[id(engine)] = {k: (before.get(k), v) for k, v in os.environ.items()
                                   if before.get(k) != v}
    startlog.record("ready", "sglang-engine", "in-process", time.monotonic() - started,
                    str(kwargs.get("model_path")))
    return engine


#: id(engine) -> {variable: (its value before the engine, the engine's)}: `sglang.Engine` sets
#: about 20 variables in its host process (cache folders, NCCL and CUDA switches, its run id)
#: and leaves them; `shutdown_engine` puts them back. Left, every launcher the process started
#: later inherited them and could not fork from a zygote imported without them.
_engine_environ: dict[int, dict[str, tuple[str | None, str]]] = {}


def _restore_environ(engine: object) -> None:
    """Undo the engine's changes to this process's environment (those nothing changed since)."""
    for name, (old, new) in _engine_environ.pop(id(engine), {}).items():
        if os.environ.get(name) != new:
            continue
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def cpu_engine_kwargs(extra: Mapping[str, object] | None = None) -> dict[str, object]:
    """Keyword arguments for `sglang.Engine(...)` in CPU mode."""
    kwargs = dict(cpu_mode.CPU_SERVER_ARGS)
    kwargs.update(extra or {})
    return kwargs


def shutdown_engine(engine: object) -> list[Path]:
    """`engine.shutdown()` for an in-process `sglang.Engine` started by `start_engine`, put
    back the variables it set in this process's environment, then remove the shared-memory
    files its processes held (SGLang leaves `sglang_loads_*.shm` and a `sem.mp-*` per engine;
    see fineslab.proctree). Returns the files removed."""
    held = tree_shm_files(descendant_pids(os.getpid()))
    try:
        engine.shutdown()  # type: ignore[attr-defined]
    finally:
        _restore_environ(engine)
        # Files still in use here or by another engine's processes stay.
        in_use = tree_shm_files([os.getpid(), *descendant_pids(os.getpid())])
        removed = remove_files(held - in_use)
    return removed


__all__: Sequence[str] = [
    "PortInUse", "ServerProcess", "ServerSpec", "cpu_engine_kwargs", "free_port",
    "prestart_zygote", "serve_zygote_to_children",
    "shutdown_engine", "start_engine", "start_server", "wait_until_up",
]

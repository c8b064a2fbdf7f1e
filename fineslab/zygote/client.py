"""The launcher's side of the zygote: start it, fork runtimes from it, watch what it forked.

`Zygote` is one zygote process; `shared_zygote(cpu)` is this process's own, started on the
first warm start and restarted (at most `MAX_DEATHS` times) when it dies. `ForkedProcess` is a
forked runtime as `subprocess.Popen` shows a child (`pid`, `poll`, `wait`, `returncode`,
signals), so `ServerProcess` and the supervisor treat both kinds of start alike.

Every failure here raises `ZygoteUnavailable` with the reason: the caller starts plainly and
says why. Costs: the zygote's first start is one import of SGLang (what a plain start pays
anyway); each fork then costs about 0.1 s of the zygote's time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path

from fineslab import startlog
from fineslab.env import FineslabEnv
from fineslab.errors import EnvironmentSetupError
from fineslab.jsonfile import write_json_whole
from fineslab.proctree import FLEET_MARKER, ProcessIdentity
from fineslab.zygote.protocol import (
    STATUS,
    ForkRequest,
    ProtocolError,
    recv_frame,
    request_body,
    send_frame,
)
from fineslab.zygote.server import IMPORTED_ENV_FILE, IMPORTED_MODULES_FILE

logger = logging.getLogger(__name__)

#: How long the zygote may take to import SGLang (25-50 s while the test suite loads 2 cores).
READY_TIMEOUT_S = 300.0
#: How long one fork request may take before the start goes plain.
FORK_TIMEOUT_S = 60.0
#: A zygote that died this many times is not restarted again: starts go plain.
MAX_DEATHS = 3
#: Variables a runtime may set differently from its zygote: fineslab's own, which are read only
#: after the fork, and pytest's (which it changes per test). Any other difference (an SGLang or
#: torch switch a module may read at import) makes that runtime start plainly.
FORK_SAFE_PREFIXES = ("FINESLAB_", "PYTEST_")
#: Variables torch reads at import that a fork applies for itself (`child.apply_thread_count`:
#: `torch.set_num_threads` sets OpenMP's and MKL's count; MKL reads its variable at its first
#: call, after the fork), and the terminal's size, read when asked (`shutil.get_terminal_size`;
#: pytest sets them).
FORK_APPLIED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "COLUMNS", "LINES")
#: How output is shown (a terminal's or a Jupyter kernel's colours and pager), read when output
#: is written; loguru reads TERM, FORCE_COLOR and NO_COLOR at import for its own sink's colours,
#: so a fork's log may differ from a plain start's in colour only. Python reads
#: PYTHONBREAKPOINT at each `breakpoint()`.
PRESENTATION = ("TERM", "CLICOLOR", "CLICOLOR_FORCE", "FORCE_COLOR", "NO_COLOR", "PAGER",
                "GIT_PAGER", "PYTHONBREAKPOINT")
#: The variables of the process a launcher may run in (a Ray worker's, a Jupyter kernel's), by
#: the package that reads them, which a runtime does not import: a fork applies them, unless its
#: zygote imported that package (`server.IMPORTED_MODULES_FILE`).
HOST_VARIABLES = (("RAY_", "ray"), ("JPY_", "jupyter_client"), ("PYDEVD_", "pydevd"),
                  ("MPLBACKEND", "matplotlib"))


def fork_safe(name: str, modules: Collection[str] | None = None) -> bool:
    """Whether a runtime may set variable `name` differently from its zygote, which imported
    the top-level packages `modules` (None: not known, so no host variable is safe)."""
    if name.startswith(FORK_SAFE_PREFIXES) or name in FORK_APPLIED or name in PRESENTATION:
        return True
    return modules is not None and any(name.startswith(prefix) and package not in modules
                                       for prefix, package in HOST_VARIABLES)


#: Room in the zygote's command line for its forks' titles (setproctitle writes them there):
#: a runtime's command line is 300-800 characters; a longer one is cut at this length.
TITLE_ROOM_CHARS = 4096
#: setproctitle keeps to the command line's room and leaves the environment block alone: each
#: fork writes its own environment there (`ENV_ROOM`), fleet marker first (the launcher's sweep
#: and the chaos benchmark find a fleet's processes by it).
TITLE_ENV = {"SPT_NOENV": "1"}
#: Room in the zygote's environment block for its forks' own environments, which each writes
#: there (`child.show_environment`): a fork's is the zygote's and its `FINESLAB_*` variables.
ENV_ROOM = {"FINESLAB_ENVIRONMENT_ROOM": "." * 4096}


class ZygoteUnavailable(EnvironmentSetupError):
    """No warm start this time (disabled, failed, gone, or this runtime cannot fork): start
    plainly. Transient: the next start asks again."""


class ZygoteAbandoned(ZygoteUnavailable):
    """A zygote stopped while it imported: its launcher is stopping."""


class ForkedProcess:
    """A runtime the zygote forked (the lifeline wrapper, its session's leader).

    Its exit status comes through a pipe the zygote writes when it reaps it; if the zygote is
    gone first (the pipe closes empty), the process is watched by its pid and an exit is
    reported as killed (-SIGKILL), its real status unknown.
    """

    def __init__(self, pid: int, status_fd: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._status_fd = status_fd
        os.set_blocking(status_fd, False)
        self._pending = b""
        self._zygote_gone = False

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._zygote_gone:
            try:
                data = os.read(self._status_fd, STATUS.size - len(self._pending))
            except BlockingIOError:
                return None
            if data:
                self._pending += data
                if len(self._pending) == STATUS.size:
                    self._finish(STATUS.unpack(self._pending)[0])
                return self.returncode
            self._zygote_gone = True
            logger.warning("the zygote that forked pid %d is gone; watching it by its pid",
                           self.pid)
        if not _pid_alive(self.pid):
            self._finish(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._zygote_gone:
                time.sleep(0.05)
            else:
                select.select([self._status_fd], [], [], 0.5 if left is None else min(left, 0.5))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _finish(self, code: int) -> None:
        self.returncode = code
        with contextlib.suppress(OSError):
            os.close(self._status_fd)

    def __del__(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                os.close(self._status_fd)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Zygote:
    """One zygote process (`python -m fineslab.zygote`) and its socket."""

    def __init__(self, env: Mapping[str, str], lifeline_fd: int,
                 preload: tuple[str, ...] | None = None, served: Path | None = None) -> None:
        """`preload`: the modules to import ahead (default: the zygote's `PRELOAD`); `served`:
        the folder of a zygote another process started and serves (`serve_zygote`), which
        this one only forks from (its `lifeline_fd` then goes with each fork, and `stop`
        leaves it running)."""
        self.env = dict(env)
        self.lifeline_fd = lifeline_fd
        self.preload = preload
        self.served = served is not None
        self.folder = served or Path(tempfile.mkdtemp(prefix="fineslab-zygote-"))
        #: The variables its imports set, with their values (`server.IMPORTED_ENV_FILE`).
        self.imported: dict[str, str] = {}
        #: The top-level packages it imported (`server.IMPORTED_MODULES_FILE`); None: not known.
        self.modules: frozenset[str] | None = None
        self.socket_path = self.folder / "zygote.sock"
        self.log_path = self.folder / "zygote.log"
        #: The zygote process (not a child: it leaves its starter's tree), once ready.
        self.identity: ProcessIdentity | None = None
        self.ready_s: float | None = None
        #: The starter's pid (its session holds the zygote) while it imports; `abandon` kills it.
        self._starter: int | None = None
        self.abandoned = False

    def start(self, timeout_s: float = READY_TIMEOUT_S, why: str = "") -> None:
        """Start the zygote and wait until it has imported SGLang; ZygoteUnavailable if not.
        `why`: what the start log says of it (the reason a served zygote did not do)."""
        argv = [sys.executable, "-m", "fineslab.zygote", "--socket", str(self.socket_path),
                "--lifeline-fd", str(self.lifeline_fd)]
        if self.preload is not None:
            argv += ["--preload", *self.preload]
        argv += ["--title-room", "." * TITLE_ROOM_CHARS]
        started = time.monotonic()
        counted = self.preload is None  # the default: SGLang's modules (a start to count)
        if counted:
            startlog.record("begin", "zygote", "imports SGLang", detail=why)
        with open(self.log_path, "wb") as log:
            starter = subprocess.Popen(argv, env={**self.env, **TITLE_ENV, **ENV_ROOM},
                                       stdout=subprocess.PIPE, stderr=log,
                                       stdin=subprocess.DEVNULL, start_new_session=True,
                                       pass_fds=(self.lifeline_fd,))
        assert starter.stdout is not None
        self._starter = starter.pid
        if self.abandoned:  # stopped before its process existed
            self._stop_group(starter.pid)
        try:
            line = _read_line(starter.stdout, timeout_s)
        except BaseException:  # interrupted (the launcher stopping): no zygote left behind
            self._stop_group(starter.pid)
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        finally:
            starter.stdout.close()
            starter.wait()  # it exits at once; the zygote is its fork
        word, _, pid = line.partition(" ")
        if self.abandoned:
            self._stop_group(starter.pid)
            shutil.rmtree(self.folder, ignore_errors=True)
            raise ZygoteAbandoned("stopped before it was ready (its launcher is stopping)")
        if word != "ready" or not pid.isdigit():
            self._stop_group(starter.pid)
            tail = self.log_tail()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise ZygoteUnavailable(f"the zygote did not start ({line or 'no answer'}); "
                                    f"its log's end:\n{tail}")
        self.identity = ProcessIdentity.of(int(pid))
        self.imported = self._read_imported()
        self.ready_s = time.monotonic() - started
        if counted:
            startlog.record("ready", "zygote", "imports SGLang", self.ready_s)
        logger.info("zygote pid %s ready in %.1f s (SGLang imported once for every runtime)",
                    pid, self.ready_s)

    def _read_imported(self) -> dict[str, str]:
        """What its imports did (`imported` returned, `modules` set), from its folder."""
        try:
            self.modules = frozenset(json.loads(
                (self.folder / IMPORTED_MODULES_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            self.modules = None
        try:
            return dict(json.loads((self.folder / IMPORTED_ENV_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return {}

    @property
    def pid(self) -> int | None:
        return None if self.identity is None else self.identity.pid

    def alive(self) -> bool:
        return self.identity is not None and self.identity.is_alive()

    def unsafe_variables(self, env: Mapping[str, str]) -> list[str]:
        """Variables `env` sets differently from the zygote's that are not safe to apply after
        the fork (`fork_safe`), but those its own imports set, with the value they set."""
        names = set(env) ^ set(self.env) | {k for k in env if self.env.get(k) != env[k]}
        # the zygote runs with TITLE_ENV whatever its environment says (a Ray worker's has it too)
        names -= {k for k, v in TITLE_ENV.items() if env.get(k, v) == v}
        return sorted(n for n in names if not fork_safe(n, self.modules)
                      and not (n in self.imported and env.get(n) == self.imported[n]))

    def fork(self, request: ForkRequest, log_fd: int) -> ForkedProcess:
        """Fork one runtime; ZygoteUnavailable (nothing started) if the zygote cannot."""
        if not self.alive():
            raise ZygoteUnavailable("the zygote is not running")
        unsafe = self.unsafe_variables(request.env)
        if unsafe:
            raise ZygoteUnavailable("the runtime's environment differs from the zygote's in "
                                    f"{', '.join(unsafe[:5])}, which a module may read at import")
        status_r, status_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(FORK_TIMEOUT_S)
                sock.connect(str(self.socket_path))
                send_frame(sock, request_body(request), [log_fd, self.lifeline_fd, status_w])
                os.close(status_w)
                status_w = -1
                reply, _ = recv_frame(sock)
        except (OSError, ProtocolError) as exc:
            os.close(status_r)
            raise ZygoteUnavailable(f"no answer from the zygote ({exc})") from None
        finally:
            if status_w >= 0:
                os.close(status_w)
        if "pid" not in reply:
            os.close(status_r)
            raise ZygoteUnavailable(f"the zygote refused: {reply.get('error', reply)}")
        return ForkedProcess(int(reply["pid"]), status_r, request.title)  # type: ignore[call-overload]

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def abandon(self) -> None:
        """Stop a zygote that is still importing, at once: its `start` raises ZygoteAbandoned
        (a launch that fails while its zygote imports ends without waiting for the import)."""
        self.abandoned = True
        if self._starter is not None and self.identity is None:
            self._stop_group(self._starter)

    def stop(self) -> None:
        """Stop the zygote (its runtimes keep running) and remove its folder; one another
        process serves is left to it."""
        if self.served:
            return
        if self.alive():
            assert self.identity is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.identity.pid, signal.SIGTERM)
            if not self.wait_gone(10.0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.identity.pid, signal.SIGKILL)
                self.wait_gone(10.0)
        shutil.rmtree(self.folder, ignore_errors=True)

    def wait_gone(self, timeout_s: float) -> bool:
        """Whether the zygote is gone within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @staticmethod
    def _stop_group(pgid: int) -> None:
        """A zygote that never got ready: its whole session (the starter and its fork)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _read_line(stream: object, timeout_s: float) -> str:
    fd = stream.fileno()  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return "timed out"
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


_lock = threading.Lock()
#: (cpu, fleet marker or "") -> the zygote; a fleet's runtimes fork from a zygote whose own
#: environment carries the fleet's marker, which /proc shows for every fork.
_zygotes: dict[tuple[bool, str], Zygote] = {}
#: Zygotes importing right now (their start holds `_lock`): what `stop_shared_zygotes` abandons.
_starting: set[Zygote] = set()
_starting_lock = threading.Lock()
_deaths: dict[tuple[bool, str], int] = {}


def zygote_environ(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a zygote for a runtime of environment `env` starts with: all of it but
    what is applied after the fork (`fork_safe`), the fleet's marker kept."""
    kept = {k: v for k, v in env.items() if not fork_safe(k)}
    if FLEET_MARKER in env:
        kept[FLEET_MARKER] = env[FLEET_MARKER]
    return kept


#: Beside a served zygote's socket: its pid, start time and environment, for other processes.
SERVED_FILE = "served.json"
#: (socket, lifeline) -> the served zygote as this process forks from it.
_served: dict[tuple[str, int], Zygote] = {}
#: The reasons a served zygote was not used, each logged once per process.
_not_served: set[str] = set()


def serve_zygote(env: Mapping[str, str], lifeline_fd: int,
                 preload: tuple[str, ...] | None = None) -> Zygote:
    """Start a zygote for runtimes of environment `env` that other processes fork from too:
    the caller sets `FINESLAB_SHARED_ZYGOTE` to its `socket_path` for its children (their
    launchers then import SGLang no more; each fork still gets its own lifeline, log, and
    environment, its fleet's marker included) and stops it when they are done. It exits when
    `lifeline_fd` closes; `preload` as `Zygote`'s. ZygoteUnavailable if it does not start."""
    zygote = Zygote(zygote_environ(env), lifeline_fd, preload)
    zygote.start()
    assert zygote.identity is not None
    write_json_whole(zygote.folder / SERVED_FILE,
                     {"pid": zygote.identity.pid, "start_ticks": zygote.identity.start_ticks,
                      "env": zygote.env})
    return zygote


def _served_zygote(socket_path: str, env: Mapping[str, str],
                   lifeline_fd: int) -> Zygote | str:
    """The zygote another process serves at `socket_path`, if it runs and a runtime of
    environment `env` can fork from it; else why not (logged once)."""
    folder = Path(socket_path).parent
    try:
        zygote = _served.get((socket_path, lifeline_fd))
        if zygote is None or not zygote.alive():
            info = json.loads((folder / SERVED_FILE).read_text())
            zygote = Zygote(info["env"], lifeline_fd, served=folder)
            zygote.identity = ProcessIdentity(int(info["pid"]), int(info["start_ticks"]))
            zygote.imported = zygote._read_imported()
            _served[(socket_path, lifeline_fd)] = zygote
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = f"no zygote is served at {socket_path} ({exc})"
    else:
        unsafe = zygote.unsafe_variables(zygote_environ(env))
        if not zygote.alive():
            reason = f"the zygote served at {socket_path} is gone"
        elif unsafe:
            reason = (f"the runtime's environment differs from the served zygote's in "
                      f"{', '.join(unsafe[:5])}")
        else:
            return zygote
    if reason not in _not_served:
        _not_served.add(reason)
        logger.info("%s: this launcher's own zygote forks it", reason)
    return reason


def shared_zygote(cpu: bool, env: Mapping[str, str], lifeline_fd: int) -> Zygote:
    """This process's zygote for CPU (or GPU) runtimes of environment `env` (of the fleet it
    marks, if any), started on first use; one that died is restarted (logged with its log's
    end), up to `MAX_DEATHS` times. A runtime whose environment differs from the zygote's in
    a variable a module may read at import (an in-process SGLang engine sets a dozen in its
    process) gets a zygote started with its environment, which replaces the old one (whose
    runtimes serve on)."""
    served = FineslabEnv.from_environ().shared_zygote
    why = ""
    if served:
        found = _served_zygote(served, env, lifeline_fd)
        if isinstance(found, Zygote):
            return found
        why = found
    key = (cpu, env.get(FLEET_MARKER, ""))
    wanted = zygote_environ(env)
    with _lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.alive() and not zygote.unsafe_variables(wanted):
            return zygote  # the rule `fork` applies, and a served zygote's (`_served_zygote`)
        if zygote is not None and zygote.alive():
            logger.info("the environment changed in %s: a new zygote replaces pid %s",
                        ", ".join(zygote.unsafe_variables(wanted)[:5]), zygote.pid)
            zygote.stop()
            del _zygotes[key]
        elif zygote is not None:
            _deaths[key] = _deaths.get(key, 0) + 1
            logger.warning("the zygote (pid %s) died (%d of %d deaths); its log's end:\n%s",
                           zygote.pid, _deaths[key], MAX_DEATHS, zygote.log_tail())
            zygote.stop()
            del _zygotes[key]
        if _deaths.get(key, 0) >= MAX_DEATHS:
            raise ZygoteUnavailable(f"the zygote died {MAX_DEATHS} times; starting plainly")
        zygote = Zygote(wanted, lifeline_fd)
        with _starting_lock:
            _starting.add(zygote)
        try:
            zygote.start(why=why)
        except ZygoteUnavailable:
            if not zygote.abandoned:  # one that cannot start will not start next time either
                _deaths[key] = MAX_DEATHS
            raise
        finally:
            with _starting_lock:
                _starting.discard(zygote)
        _zygotes[key] = zygote
        return zygote


def dead_zygotes() -> bool:
    """Whether one of this process's zygotes died (and may still be restarted)."""
    with _lock:
        return any(not z.alive() and _deaths.get(key, 0) < MAX_DEATHS - 1
                   for key, z in _zygotes.items())


def revive_dead_zygotes() -> None:
    """Restart this process's zygotes that died, now rather than at the next start (which
    would pay the import); the fleet's supervisor calls this from a thread of its own."""
    with _lock:
        dead = [(key, z) for key, z in _zygotes.items() if not z.alive()]
    for (cpu, _), zygote in dead:
        try:
            shared_zygote(cpu, zygote.env, zygote.lifeline_fd)
        except ZygoteUnavailable as exc:
            logger.warning("the zygote is not restarted: %s", exc)


def stop_shared_zygotes() -> None:
    """Stop this process's zygotes (their runtimes keep running); the next start makes new. One
    still importing is abandoned first, so that this does not wait for its import."""
    with _starting_lock:
        starting = list(_starting)
    for zygote in starting:
        zygote.abandon()
    with _lock:
        for zygote in _zygotes.values():
            zygote.stop()
        _zygotes.clear()
        _deaths.clear()

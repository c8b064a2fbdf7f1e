"""What a process forked by the zygote does: become one runtime, exactly as a plain start would.

    zygote ──fork──> wrapper (session leader; `fineslab.lifeline`'s watch)
                        └──fork──> server (`module` run as __main__) ──> SGLang's children

A plain start runs `python -m fineslab.lifeline --fd N -- python -m sglang.launch_server ...`;
here both processes are forks instead of fresh interpreters, and everything that makes them
this runtime is applied after the fork, before any of its code runs:

- the descriptors: stdin is /dev/null, stdout and stderr go to the runtime's log, the lifeline
  is the launcher's pipe, and every descriptor the zygote holds for itself or for its other
  runtimes is closed;
- the environment (`os.environ` is replaced whole, so `subprocess` and SGLang's own children
  see it too), and what /proc shows of it: the fork's own, written over the zygote's in the
  process's environment block (`show_environment`), so a fleet's processes carry its marker
  whichever zygote forked them; the compute threads (`OMP_NUM_THREADS`, which torch read at
  the zygote's import, applied with `torch.set_num_threads`); the working folder, `sys.argv`,
  the default signal handlers;
- the command line `ps` shows (`setproctitle`, as SGLang titles its own children): the same as
  a plain start's, so operators and tools find `sglang.launch_server` and `fineslab.lifeline`.

Neither process returns into the zygote's code: each leaves with `os._exit`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Mapping
from typing import NoReturn

from fineslab.proctree import FLEET_MARKER
from fineslab.zygote.protocol import ForkRequest


def become_runtime(request: ForkRequest, log_fd: int, lifeline_fd: int,
                   zygote_fds: list[int], settled_fd: int) -> NoReturn:
    """The wrapper: set up the runtime's process, fork its server, watch both until it ends.
    `settled_fd` is closed once this process leads its own session (the zygote then answers)."""
    code = 1
    try:
        for fd in zygote_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.setsid()
        os.close(settled_fd)
        fresh_interpreter_signals()
        _redirect(log_fd)
        _forget_zygote_logging()
        set_title(request.wrapper_title)  # first: setproctitle reads SPT_NOENV once, here
        os.environ.clear()
        os.environ.update(request.env)
        show_environment(request.env)
        os.chdir(request.cwd)
        from fineslab.lifeline import watch

        server = _ForkedServer(os.fork())
        if server.pid == 0:
            _run_server(request)
        code = watch(lifeline_fd, server, " ".join(request.title[:4]), request.grace_s)
    except BaseException:  # whatever happens, never return into the zygote
        traceback.print_exc()
    _leave(code)


#: The variable the zygote's torch read at import that a fork applies for itself.
THREADS_VAR = "OMP_NUM_THREADS"


def show_environment(env: Mapping[str, str]) -> bool:
    """Write `env` over this process's environment block (what /proc/<pid>/environ and `ps e`
    show, and what the fleet sweeps read a fleet's marker from), NUL-padded, the fleet's marker
    first and whole entries only where it does not all fit. Call it once `os.environ` holds
    `env`: libc's own copy then points at new strings, never at the block (checked; False and
    nothing written if one still does, or the block cannot be found)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (stat(5))
    except (OSError, IndexError, ValueError):
        return False
    libc = ctypes.CDLL(None)
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    i = 0
    while environ[i]:
        if start <= environ[i] < end:
            return False
        i += 1
    entries = sorted(env.items(), key=lambda kv: kv[0] != FLEET_MARKER)
    room, data = end - start, b""
    for name, value in entries:
        entry = f"{name}={value}".encode(errors="surrogateescape") + b"\0"
        if len(data) + len(entry) <= room:
            data += entry
    ctypes.memmove(start, data.ljust(room, b"\0"), room)
    return True


def apply_thread_count(env: Mapping[str, str]) -> None:
    """torch's compute threads as `env`'s `OMP_NUM_THREADS` says (unset: every core this
    process may run on), where the zygote imported torch with another value."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    raw = env.get(THREADS_VAR, "")
    wanted = int(raw) if raw.isdigit() and int(raw) > 0 else len(os.sched_getaffinity(0))
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def fresh_interpreter_signals() -> None:
    """The signal dispositions a fresh `python` starts with, whatever the zygote set: the
    defaults, except SIGINT (KeyboardInterrupt) and SIGPIPE and SIGXFSZ, which CPython ignores
    so that a write to a closed socket or a full file is an OSError, not a silent death. (With
    SIGPIPE at its default, a warm runtime died without a word the first time it wrote to a
    connection its client had closed: the engine benchmark's dropped streams.)"""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)


class _ForkedServer:
    """The server process, polled the way `fineslab.lifeline` polls a `subprocess.Popen`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _run_server(request: ForkRequest) -> NoReturn:
    code: int = 1
    try:
        set_title(request.title)
        apply_thread_count(request.env)
        if request.fork_children:
            from fineslab.cpu_mode.forked import fork_children

            fork_children()
        sys.argv = [request.module, *request.args]
        sys.modules.pop(request.module, None)  # run as __main__, as `python -m` runs it
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # the traceback goes to the runtime log
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # what the interpreter's own exit would have run
    _leave(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _redirect(log_fd: int) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    if log_fd > 2:
        os.close(log_fd)


def _forget_zygote_logging() -> None:
    """The zygote's log handlers are its own: the runtime configures logging as a fresh
    interpreter would (SGLang's server does it once it starts)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def set_title(argv: list[str]) -> None:
    """What `ps` shows for this process (within the zygote's command line's room)."""
    try:
        import setproctitle
    except ImportError:  # an SGLang dependency; without it `ps` shows the zygote's line
        return
    setproctitle.setproctitle(" ".join(argv))


def _leave(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code & 0xFF if code >= 0 else 128 - code)

"""The zygote process: SGLang imported once, each runtime forked from it.

    python -m fineslab.zygote --socket PATH --lifeline-fd N [--preload MODULE ...]

It leaves its launcher's process tree at once (`_detach`), imports `PRELOAD` (torch, SGLang's
server, scheduler, detokenizer, tokenizer manager, model runner and model code, the fineslab
plugin), prints `ready <pid>` on stdout, and then serves fork
requests on its unix socket (`protocol.py`), one at a time. It never runs a torch operation
and never touches CUDA: before each fork it checks that CUDA is still uninitialised (a CUDA
context does not survive a fork) and answers an error instead, so the launcher starts that
runtime plainly and says why. Nothing a runtime is told is read here: its arguments,
environment and arena are applied in the forked child (`child.py`).

It reaps its runtimes and writes each one's exit status to the pipe that came with its
request. It exits when its launcher's lifeline closes (the launcher is gone, however it
ended), on SIGTERM, or when its socket is removed; the runtimes it forked are not its to stop
(each watches the same lifeline). A launcher that died leaves its fleet's arena files and run
record to the fleet's last process out: the zygote takes its share of that
(`fineslab.lifeline.remove_dead_fleet_files`), as it may be all there is of a fleet whose
launcher died while starting its runtimes.

Invariant: `tracked` holds exactly the status pipes of forked runtimes not yet reaped; every
descriptor of the zygote's own (its socket, its lifeline, `tracked`) is closed in each child.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import time

from fineslab.lifeline import remove_dead_fleet_files
from fineslab.zygote.protocol import (
    NUM_FDS,
    STATUS,
    ForkRequest,
    ProtocolError,
    recv_frame,
    send_frame,
)

logger = logging.getLogger("fineslab.zygote")

#: What a runtime would import first: importing these once is what makes a warm start warm.
PRELOAD = (
    "torch",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.registry",  # imports every model module SGLang knows (about 1 s)
    "sglang.launch_server",
    "fineslab.sglang_plugin",
    "fineslab.cpu_mode.forked",
    "fineslab.lifeline",
)
#: How long a fork's answer waits for the child to lead its own session.
SETTLE_TIMEOUT_S = 10.0
#: How long the loop waits for a request before it reaps and looks at its lifeline again.
TICK_S = 0.1


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


class ZygoteServer:
    def __init__(self, socket_path: str, lifeline_fd: int) -> None:
        self.socket_path = socket_path
        self.lifeline_fd = lifeline_fd
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_path)
        os.chmod(socket_path, 0o600)
        self.listener.listen(16)
        self.tracked: dict[int, int] = {}  # runtime pid -> its status pipe's write end

    def serve(self) -> str:
        """Serve until the launcher is gone ("lifeline") or the socket removed ("socket")."""
        while True:
            watched = [self.listener.fileno(), self.lifeline_fd]
            readable, _, _ = select.select(watched, [], [], TICK_S)
            if self.lifeline_fd in readable and not os.read(self.lifeline_fd, 1):
                logger.info("fineslab zygote: its launcher is gone; exiting")
                return "lifeline"
            if self.listener.fileno() in readable:
                self.accept()
            self.reap()
            if not os.path.exists(self.socket_path):
                logger.info("fineslab zygote: its socket was removed; exiting")
                return "socket"

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10.0)
            try:
                body, fds = recv_frame(conn, NUM_FDS)
            except (ProtocolError, OSError) as exc:
                logger.warning("fineslab zygote: a bad request (%s)", exc)
                return
            try:
                reply = self.fork(body, fds)
            finally:
                for fd in fds[:2]:
                    os.close(fd)
            with contextlib.suppress(OSError):
                send_frame(conn, reply)

    def fork(self, body: dict[str, object], fds: list[int]) -> dict[str, object]:
        """Fork one runtime; the status pipe (fds[2]) is kept until it is reaped."""
        if len(fds) != NUM_FDS:
            for fd in fds[2:]:
                os.close(fd)
            return {"error": f"expected {NUM_FDS} descriptors, got {len(fds)}"}
        log_fd, lifeline_fd, status_fd = fds
        try:
            request = ForkRequest.from_json(body)
        except ProtocolError as exc:
            os.close(status_fd)
            return {"error": str(exc)}
        if cuda_initialized():
            os.close(status_fd)
            return {"error": "CUDA is initialised in the zygote (a fork would not inherit it)"}
        settled_r, settled_w = os.pipe()
        own = [self.listener.fileno(), self.lifeline_fd, status_fd, settled_r,
               *self.tracked.values()]
        pid = os.fork()
        if pid == 0:
            from fineslab.zygote.child import become_runtime

            become_runtime(request, log_fd, lifeline_fd, own, settled_w)
        os.close(settled_w)
        self.tracked[pid] = status_fd
        # Answer once the child leads its own session (as Popen(start_new_session=True) returns
        # after the child's setsid): a signal to the group right after must reach it.
        select.select([settled_r], [], [], SETTLE_TIMEOUT_S)
        os.close(settled_r)
        logger.info("fineslab zygote: forked %s as pid %d", " ".join(request.title[:8]), pid)
        return {"pid": pid}

    def reap(self) -> None:
        while self.tracked:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = self.tracked.pop(pid, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.write(fd, STATUS.pack(os.waitstatus_to_exitcode(status)))
                os.close(fd)

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        for fd in self.tracked.values():
            os.close(fd)  # the launcher reads EOF: status unknown, it falls back on the pid


def _detach() -> None:
    """Leave the launcher's process tree (the first process exits at once, the zygote goes on
    in a fork of it): SGLang's in-process `Engine.shutdown()` kills every descendant of its
    process, and a test run of 22 engines killed the test process's zygote each time. The
    lifeline, not the tree, ties the zygote to its launcher."""
    if os.fork() > 0:
        os._exit(0)


def preload(modules: tuple[str, ...], lifeline_fd: int) -> bool:
    """Import `modules`; False as soon as the launcher is found gone between two of them."""
    for name in modules:
        if _gone(lifeline_fd):
            return False
        started = time.monotonic()
        importlib.import_module(name)
        logger.info("fineslab zygote: imported %s in %.2f s", name, time.monotonic() - started)
    return True


def _gone(lifeline_fd: int) -> bool:
    readable, _, _ = select.select([lifeline_fd], [], [], 0)
    return bool(readable) and not os.read(lifeline_fd, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fineslab.zygote",
        description="Import SGLang once and fork fineslab's runtimes from here (started by "
                    "fineslab itself; see fineslab/zygote/__init__.py).")
    parser.add_argument("--socket", required=True, help="unix socket to serve fork requests on")
    parser.add_argument("--lifeline-fd", type=int, required=True,
                        help="read end of the launcher's lifeline pipe (exit at its EOF)")
    parser.add_argument("--title-room", default="",
                        help="filler that makes room in this command line for the titles "
                             "of the forks (setproctitle writes there)")
    parser.add_argument("--preload", nargs="*", metavar="MODULE",
                        help="modules to import ahead (default: torch, SGLang's server, "
                             "scheduler and model code, the plugin; none given: none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is the launcher's
    _detach()
    zygote = os.getpid()
    try:
        return _serve(args)
    finally:
        # However it ends (SIGTERM too) once its launcher is gone; never in a fork, whose
        # copy of the lifeline is closed.
        if os.getpid() == zygote and _gone(args.lifeline_fd):
            _after_launcher(args.socket)


#: Beside the socket: the variables the zygote's imports set in its environment (`import
#: sglang` points five third-party caches at SGLang's folder), which a runtime's environment
#: may then hold with the same values (a plain start's imports set them alike).
IMPORTED_ENV_FILE = "imported-env.json"
#: Beside the socket: the top-level packages it imported, sorted (a variable of a package it
#: did not import, a Ray worker's or a Jupyter kernel's, is safe to apply after the fork).
IMPORTED_MODULES_FILE = "imported-modules.json"


def _serve(args: argparse.Namespace) -> int:
    try:
        before = dict(os.environ)
        if not preload(PRELOAD if args.preload is None else tuple(args.preload),
                       args.lifeline_fd):
            return 0
        imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
        with open(os.path.join(os.path.dirname(args.socket), IMPORTED_ENV_FILE), "w") as f:
            json.dump(imported, f)
        with open(os.path.join(os.path.dirname(args.socket), IMPORTED_MODULES_FILE), "w") as f:
            json.dump(sorted({name.partition(".")[0] for name in sys.modules}), f)
        if cuda_initialized():
            _tell("error: importing SGLang initialised CUDA; runtimes start plainly")
            return 3
        server = ZygoteServer(args.socket, args.lifeline_fd)
    except Exception as exc:  # told to the launcher, which starts plainly
        _tell(f"error: {type(exc).__name__}: {exc}")
        return 2
    from fineslab.zygote.child import set_title

    set_title([sys.executable, "-m", "fineslab.zygote", "--socket", args.socket])
    gc.freeze()  # the imported objects stay shared with every fork (no gc writes to them)
    _tell(f"ready {os.getpid()}")
    try:
        server.serve()
    finally:
        server.close()
    return 0


def _tell(line: str) -> None:
    """A line to the launcher, which may be gone (its pipe closed: nothing to tell)."""
    with contextlib.suppress(BrokenPipeError):
        print(line, flush=True)


def _after_launcher(socket_path: str) -> None:
    """The launcher is gone: remove what it made that nobody else is left to (before, a zygote
    told of it while importing died of the closed pipe and left the fleet's arena behind)."""
    logger.info("fineslab zygote: its launcher is gone; removing what it left")
    folder = os.path.dirname(socket_path)
    if os.path.basename(folder).startswith("fineslab-zygote-"):
        shutil.rmtree(folder, ignore_errors=True)
    remove_dead_fleet_files()

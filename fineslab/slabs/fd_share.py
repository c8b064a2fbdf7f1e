"""Handing the arena's file descriptors to runtimes over a unix socket (SCM_RIGHTS).

A CUDA arena on virtual memory (cuda_vmm.py) is one exported allocation per slab, each a file
descriptor of the launcher. A runtime needs its own duplicates. `pidfd_getfd(2)` would take them
straight from the launcher, but needs ptrace access to it, which a non-root runtime under the
default `kernel.yama.ptrace_scope = 1` lacks (scope 1 lets only an ancestor trace, and the
runtime is the launcher's child). So the launcher serves them, as CUDA's own IPC samples do:

    FdServer(path, fds)   a thread accepting on a unix socket at `path` (mode 0600, messages
                          kept apart: SOCK_SEQPACKET); to each
                          peer of the same uid (SO_PEERCRED) it sends the count, then the
                          descriptors in batches of BATCH (SCM_RIGHTS)
    fetch_fds(path)       connect, read the count, receive every batch: this process's
                          duplicates, in the server's order

    fetch_fds(path) == duplicates of fds, in order; a peer of another uid gets nothing
Cost: one connection per runtime start; the kernel duplicates each descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from pathlib import Path

from fineslab.errors import EnvironmentSetupError

logger = logging.getLogger(__name__)

#: Descriptors per message (the kernel's SCM_MAX_FD is 253).
BATCH = 200
_COUNT = struct.Struct("!I")
_TIMEOUT_S = 30.0


class FdServer:
    """Serves `fds` to same-uid peers at `path` until `close()` (module doc)."""

    def __init__(self, path: Path, fds: list[int]) -> None:
        self.path, self._fds = path, list(fds)
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old_umask = os.umask(0o177)  # the socket is created 0600: the fleet's user only
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old_umask)
        self._sock.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fineslab-fd-server",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:
                    logger.warning("arena descriptors: a peer left mid-answer: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(_TIMEOUT_S)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            logger.warning("arena descriptors: refused a peer of uid %d", uid)
            return
        conn.send(_COUNT.pack(len(self._fds)))
        for start in range(0, len(self._fds), BATCH):
            batch = self._fds[start: start + BATCH]
            socket.send_fds(conn, [_COUNT.pack(len(batch))], batch)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


def _recv_count(conn: socket.socket) -> int:
    data = conn.recv(_COUNT.size)  # one whole message (SOCK_SEQPACKET keeps their bounds)
    if len(data) != _COUNT.size:
        raise EnvironmentSetupError("the arena's descriptor server closed the connection")
    return int(_COUNT.unpack(data)[0])


def fetch_fds(path: Path) -> list[int]:
    """This process's duplicates of the descriptors served at `path` (EnvironmentSetupError
    when the server is gone or refuses)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(_TIMEOUT_S)
    got: list[int] = []
    try:
        try:
            conn.connect(str(path))
            count = _recv_count(conn)
        except (OSError, EnvironmentSetupError) as exc:
            raise EnvironmentSetupError(f"the arena's descriptors at {path} are not served "
                                        f"(is the launcher alive?): {exc}") from exc
        while len(got) < count:
            _message, fds, _flags, _addr = socket.recv_fds(conn, _COUNT.size, BATCH)
            if not fds:
                raise EnvironmentSetupError(f"the arena's descriptor server at {path} sent "
                                            f"{len(got)} of {count} descriptors")
            got.extend(fds)
        return got
    except BaseException:
        for fd in got:
            os.close(fd)
        raise
    finally:
        conn.close()

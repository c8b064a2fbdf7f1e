"""What a launcher and its zygote say to each other over the zygote's unix socket.

One connection per fork. The launcher sends one `ForkRequest` with three descriptors beside it
(SCM_RIGHTS), in this order:

    log_fd       the runtime's stdout and stderr (its log file, or /dev/null)
    lifeline_fd  the read end of the launcher's lifeline pipe (`fineslab.lifeline`)
    status_fd    the write end of a pipe the zygote writes the runtime's exit status to

and reads one reply: `{"pid": N}` (the runtime's lifeline wrapper, the leader of its own
session) or `{"error": "..."}` (nothing was forked; start plainly). Frames are a 4-byte
big-endian length and a JSON object; a frame over `MAX_FRAME_BYTES` is refused.

The exit status is a 4-byte signed integer in `subprocess.Popen.returncode`'s convention (the
exit code, or minus the signal that killed it), written once when the zygote reaps the runtime.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

#: A request holds a runtime's whole environment: generous, but bounded.
MAX_FRAME_BYTES = 4 << 20
#: Descriptors that travel with a request (log, lifeline, status).
NUM_FDS = 3
STATUS = struct.Struct("!i")


class ProtocolError(Exception):
    """A frame that is not what the protocol says (truncated, too long, not a JSON object)."""


@dataclass(frozen=True)
class ForkRequest:
    """One runtime to fork: what a plain start would have run, and how to show it.

    `module` is run as `__main__` with `args` (as `python -m module args...` would);
    `fork_children`: SGLang's own children are forked too (`fineslab.cpu_mode.forked`, CPU
    only); `title` and `wrapper_title` are the command lines `ps` shows for the server and its
    lifeline wrapper, the same as a plain start's.
    """

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    title: list[str]
    wrapper_title: list[str]
    fork_children: bool = False
    grace_s: float = 8.0

    @classmethod
    def from_json(cls, body: Mapping[str, object]) -> ForkRequest:
        try:
            request = cls(**body)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ProtocolError(f"bad fork request: {exc}") from None
        strings = (request.module, request.cwd, *request.args, *request.title,
                   *request.wrapper_title, *request.env.keys(), *request.env.values())
        if not all(isinstance(s, str) for s in strings):
            raise ProtocolError("bad fork request: module, args, env, cwd and titles are strings")
        return request


def send_frame(sock: socket.socket, body: Mapping[str, object], fds: Sequence[int] = ()) -> None:
    data = json.dumps(body).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes is over {MAX_FRAME_BYTES}")
    frame = struct.pack("!I", len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def recv_frame(sock: socket.socket, num_fds: int = 0) -> tuple[dict[str, object], list[int]]:
    """One frame and the descriptors sent with it (the caller owns and closes them)."""
    head, fds, _, _ = socket.recv_fds(sock, 4, num_fds) if num_fds else (sock.recv(4), [], 0, 0)
    try:
        head += _recv_exact(sock, 4 - len(head)) if head else b""
        if len(head) != 4:
            raise ProtocolError("connection closed before a frame")
        (length,) = struct.unpack("!I", head)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {length} bytes is over {MAX_FRAME_BYTES}")
        body = json.loads(_recv_exact(sock, length))
        if not isinstance(body, dict):
            raise ProtocolError("frame is not a JSON object")
    except (ProtocolError, ValueError) as exc:
        for fd in fds:
            _close(fd)
        raise ProtocolError(str(exc)) from None
    return body, list(fds)


def request_body(request: ForkRequest) -> dict[str, object]:
    return asdict(request)


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, left = [], num_bytes
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ProtocolError("connection closed inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)

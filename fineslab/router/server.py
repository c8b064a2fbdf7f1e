"""Run the router's uvicorn server in a background thread (the launcher and tests use it).

    server = RouterServer(router, host="127.0.0.1", port=0)   # port 0: any free port
    server.start()          # returns once the socket accepts connections
    server.base_url         # "http://127.0.0.1:PORT"
    server.stop()           # graceful: in-flight responses finish, then the loop ends

`bind_router_socket(host, port)` binds (and listens on) the router's port at once, so that a
launcher can claim it before the minutes of starting runtimes and fail at once if it is taken;
give the socket to `RouterServer(..., sock=...)`.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from fineslab.errors import EnvironmentSetupError
from fineslab.router.app import Router
from fineslab.router.http import create_app
from fineslab.runtime import free_port

logger = logging.getLogger(__name__)


def bind_router_socket(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port`; EnvironmentSetupError naming the port if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        what = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
        raise EnvironmentSetupError(
            f"router port {port} on {host} {what}; stop what holds it or choose another "
            "(--port or router.port)") from None
    sock.set_inheritable(False)
    return sock


class AppServer:
    """An ASGI app's uvicorn in a background thread; `what` names it in messages."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", sock: socket.socket | None = None,
                 what: str = "router") -> None:
        self.host, self.what = host, what
        self.port = sock.getsockname()[1] if sock is not None else (port or free_port(host))
        self._sockets = [sock] if sock is not None else None
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, args=(self._sockets,),
                                        name=f"fineslab-{what.replace(' ', '-')}", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise EnvironmentSetupError(f"{self.what} failed to start on {self.base_url}")
            if time.monotonic() > deadline:
                raise EnvironmentSetupError(f"{self.what} not listening on {self.base_url} "
                                            f"after {timeout_s:.0f} s")
            time.sleep(0.02)
        logger.info("%s listening on %s", self.what, self.base_url)

    def serve_in_foreground(self) -> None:
        """Run in the calling thread until `stop()` is called from elsewhere."""
        self._server.run(self._sockets)

    def stop(self, timeout_s: float = 15.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)


class RouterServer(AppServer):
    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", sock: socket.socket | None = None) -> None:
        super().__init__(create_app(router), host, port, log_level, sock, "router")
        self.router = router

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop serving: in-flight requests end at once in their error (their runtimes are
        stopped next), then the server closes."""
        if self._server.started:
            self.router.stop_serving()
        super().stop(timeout_s)

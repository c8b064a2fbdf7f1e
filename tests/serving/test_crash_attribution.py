"""Crash attribution (issue #15): a request that takes its runtime down gets the error, the
others in flight with it are served. The runtime is the echo backend, which exits on a body
with `echo_crash`; the test plays the supervisor (mark down, restart, mark up)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fineslab.router import ModelRoute, ReplicaRoute, Router, RouterServer, RouterSettings
from fineslab.router.testing import FixedTtftPredictor, start_echo_backend
from fineslab.runtime import free_port


@pytest.fixture(params=[2.0, 60.0], ids=["quick-restart", "restart-past-the-slo"])
def supervised(request: pytest.FixtureRequest) -> Iterator[tuple[RouterServer, list[int]]]:
    """A router over an echo backend that a watcher restarts whenever it exits, announcing
    the restart in `request.param` seconds (the route's SLO is 30 s)."""
    back_in_s = request.param
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    route = ModelRoute("m", (ReplicaRoute("m-r0", url),), 30.0, FixedTtftPredictor(),
                       tokenizer_dir=None, context_tokens=256, max_running_requests=8)
    server = RouterServer(Router([route], RouterSettings()))
    server.start()
    backend = [start_echo_backend(port, delay_s=1.0)]
    restarts: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            if backend[0].poll() is not None:
                restarts.append(1)  # counted first: the router may answer before the restart
                server.router.mark_down("m-r0", reason="exited with 1", back_in_s=back_in_s)
                backend[0] = start_echo_backend(port, delay_s=1.0)
                server.router.mark_up("m-r0")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield server, restarts
    stop.set()
    watcher.join(10)
    server.stop()
    backend[0].terminate()
    backend[0].wait(10)


def _post(server: RouterServer, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


def _resend_until_settled(server: RouterServer, body: dict[str, object]) -> httpx.Response:
    """A client's retries: resend while the answer says the runtime failed or is away."""
    for _ in range(30):
        reply = _post(server, body)
        if reply.status_code not in (502, 503):
            return reply
        time.sleep(0.5)
    return reply


def test_the_request_that_kills_its_runtime_gets_the_error_and_the_others_are_served(
        supervised: tuple[RouterServer, list[int]]) -> None:
    # With a quick restart the router retries the suspects itself; with a restart past the
    # SLO they get the runtime's 502 and their clients' retries go through the quarantine.
    server, restarts = supervised
    good = {"model": "m", "prompt": "fine", "max_tokens": 2}
    poison = {"model": "m", "prompt": "deadly", "max_tokens": 2, "echo_crash": True}
    with ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(_resend_until_settled, server, good) for _ in range(3)]
        time.sleep(0.3)  # the good ones are in flight (the backend answers after 1 s)
        bad = pool.submit(_resend_until_settled, server, poison)
        replies = [f.result() for f in goods]
        refused = bad.result()
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "request_crashed_runtime"
    # The router answers the poison as soon as its connection drops; the watcher sees the
    # exit up to 0.1 s later.
    deadline = time.monotonic() + 5
    while len(restarts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(restarts) == 2, "it crashed its runtime twice: once with others, once alone"
    again = _post(server, poison)
    assert again.status_code == 400 and again.elapsed.total_seconds() < 0.5
    assert len(restarts) == 2, "a known poison is refused without reaching a runtime"
    assert _resend_until_settled(server, good).status_code == 200  # once it is back up

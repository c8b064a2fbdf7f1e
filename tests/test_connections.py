"""Pooled connections outlive no server's keep-alive (`fineslab.connections`): a POST on a
connection the server closed while the client's loop was busy failed as a 502 with
ServerDisconnectedError (CI, the capacity benchmark: five requests no runtime saw)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest

from fineslab.connections import CLIENT_KEEPALIVE_S, pooled_connector
from fineslab.router.server import AppServer

#: uvicorn's default keep-alive (s), SGLang's too (`SGLANG_TIMEOUT_KEEP_ALIVE`) and the router's.
SERVER_KEEPALIVE_S = 5


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = AppServer(_ok, what="keep-alive test server")  # the router's uvicorn settings
    server.start()
    yield server.base_url + "/"
    server.stop()


async def _second_post_past_the_keepalive(url: str,
                                          connector: Callable[[], aiohttp.TCPConnector]) -> str:
    """A second POST on the pool, sent from a loop that was too busy to see the server close
    the first one's connection: "ok" or the error's name."""
    async with aiohttp.ClientSession(connector=connector()) as session:
        async with session.post(url) as reply:
            assert await reply.read() == b"ok"
        time.sleep(SERVER_KEEPALIVE_S + 0.5)  # busy: no loop turn sees the connection close
        try:
            async with session.post(url) as reply:
                return (await reply.read()).decode()
        except aiohttp.ClientError as exc:
            return type(exc).__name__


def test_a_pooled_connection_is_not_reused_after_the_server_let_it_go(url: str) -> None:
    assert CLIENT_KEEPALIVE_S < SERVER_KEEPALIVE_S - 2
    assert asyncio.run(_second_post_past_the_keepalive(url, pooled_connector)) == "ok"


def test_aiohttps_own_pool_reuses_it_the_control(url: str) -> None:
    """Without `pooled_connector`, the same POST fails: what the 502s were."""
    outcome = asyncio.run(_second_post_past_the_keepalive(
        url, lambda: aiohttp.TCPConnector(limit=0)))
    assert outcome == "ServerDisconnectedError"

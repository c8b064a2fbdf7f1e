"""Pooled HTTP connections to uvicorn servers (SGLang's runtimes, the router, the nodes).

uvicorn closes a connection that has been idle for 5 s (its default, and SGLang's
`SGLANG_TIMEOUT_KEEP_ALIVE`); aiohttp keeps an idle connection for 15 s and hands out the
oldest first. A POST sent on a connection the server is closing at that moment fails with
`ServerDisconnectedError` although no server saw it (aiohttp resends only idempotent methods):
a 502 for a request that was never served. The client here drops its idle connections well
before any server does, so a connection it reuses is one the server still keeps.
"""

from __future__ import annotations

import aiohttp

#: How long an idle pooled connection is reused (s); under the servers' 5 s keep-alive.
CLIENT_KEEPALIVE_S = 2.0


def pooled_connector() -> aiohttp.TCPConnector:
    """A connector without a connection limit whose idle connections go before a server's."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)

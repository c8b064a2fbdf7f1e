"""Live state of each runtime behind the router: up or down, requests in flight, restarts.

A `Replica` is touched only on the router's event loop. The supervisor (another thread) calls
`Router.mark_down` / `mark_up`, which hop onto the loop. Going down resolves `down`, a future
every in-flight proxy call races against (one shared future, so a guard costs one task, not
two), so a dead runtime's requests end with an error at once instead of waiting for a TCP
timeout; going up installs a fresh future.

    inflight == number of leases handed out on this replica and not yet released
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp

from fineslab.router.config import ReplicaRoute

T = TypeVar("T")


class RuntimeDown(Exception):
    """The runtime serving a request died (or was marked down) before it finished."""

    def __init__(self, runtime_id: str) -> None:
        super().__init__(f"runtime {runtime_id} went down while serving this request")
        self.runtime_id = runtime_id


class Replica:
    def __init__(self, route: ReplicaRoute, client: aiohttp.ClientSession) -> None:
        self.route = route
        self.client = client
        self.up = True
        self.inflight = 0
        self.restarts = 0
        self.pid: int | None = None
        self.down: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def runtime_id(self) -> str:
        return self.route.runtime_id

    def mark_down(self) -> None:
        self.up = False
        if not self.down.done():
            self.down.set_result(None)

    def move(self, base_url: str, client: aiohttp.ClientSession) -> aiohttp.ClientSession:
        """Serve from `base_url` with `client` from now on; return the old client to close."""
        old, self.client = self.client, client
        self.route = replace(self.route, base_url=base_url)
        return old

    def mark_up(self, restarted: bool) -> None:
        if self.down.done():
            self.down = asyncio.get_running_loop().create_future()
        self.up = True
        if restarted:
            self.restarts += 1

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, or raise RuntimeDown as soon as this replica goes down."""
        down = self.down
        if down.done():
            raise RuntimeDown(self.runtime_id)
        work = asyncio.ensure_future(awaitable)
        waiters: list[asyncio.Future[Any]] = [work, down]
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            raise
        if work in done:
            return work.result()
        work.cancel()
        raise RuntimeDown(self.runtime_id)

    def state(self) -> dict[str, object]:
        return {"runtime_id": self.runtime_id, "url": self.route.base_url,
                "state": "up" if self.up else "down", "inflight": self.inflight,
                "restarts": self.restarts, "pid": self.pid}

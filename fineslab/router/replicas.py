"""Live state of each runtime behind the router: up or down, requests in flight, restarts.

A `Replica` is touched only on the router's event loop. The supervisor (another thread) calls
`Router.mark_down` / `mark_up`, which hop onto the loop. Going down resolves `down`, a future
every in-flight proxy call races against (one shared future, so a guard costs one task, not
two), so a dead runtime's requests end with an error at once instead of waiting for a TCP
timeout; going up installs a fresh future.

    inflight == number of leases handed out on this replica and not yet released
    restarts == number of times it went down and was (or is being) restarted

A replica marked down carries the supervisor's reason (`exited`, `hung`, ...) and when it is
expected back (`back_at_s`, on the router's monotonic clock; None when unknown): the queue
rejects at once what cannot wait that long, with a `Retry-After` that says how long.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp

from fineslab.router.routes import ReplicaRoute

T = TypeVar("T")
logger = logging.getLogger(__name__)
#: An abort is one small call to a live runtime; a hung one is not waited for.
ABORT_TIMEOUT_S = 10.0


class RuntimeDown(Exception):
    """The runtime serving a request died (or was marked down) before it finished."""

    def __init__(self, runtime_id: str, reason: str | None = None) -> None:
        why = f" ({reason}); it is being restarted" if reason else ""
        super().__init__(f"runtime {runtime_id} went down while serving this request{why}")
        self.runtime_id = runtime_id
        #: 504 for a runtime that stopped answering, 502 for one that died.
        self.status = 504 if reason is not None and reason.startswith("hung") else 502


async def unless(awaitable: Awaitable[T], stop: asyncio.Future[Any]) -> asyncio.Future[T] | None:
    """`awaitable`, finished, as a future; or None, having cancelled it, when `stop` resolves
    first. A cancel of the caller cancels it too."""
    work = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    if work in done:
        return work
    work.cancel()
    return None


def discard(awaitable: Awaitable[Any]) -> None:
    """Drop an awaitable that will not be awaited (a guard refusing at once): a coroutine is
    closed, so that Python does not warn that it was never awaited."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()


class Replica:
    def __init__(self, route: ReplicaRoute, client: aiohttp.ClientSession) -> None:
        self.route = route
        self.client = client
        self.up = True
        self.inflight = 0
        self.restarts = 0
        self.pid: int | None = None
        self.down_reason: str | None = None
        self.back_at_s: float | None = None
        self.down: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._aborts: set[asyncio.Future[None]] = set()

    @property
    def runtime_id(self) -> str:
        return self.route.runtime_id

    def mark_down(self, reason: str | None = None, back_in_s: float | None = None) -> None:
        """Down; with a `reason`, the supervisor is restarting it (counted in `restarts`)."""
        if self.up and reason is not None:
            self.restarts += 1
        self.up = False
        self.down_reason = reason
        self.back_at_s = None if back_in_s is None else time.monotonic() + back_in_s
        if not self.down.done():
            self.down.set_result(None)

    def retry_after_s(self) -> int | None:
        """Whole seconds until it is expected back (None: unknown or up)."""
        if self.up or self.back_at_s is None:
            return None
        return max(1, math.ceil(self.back_at_s - time.monotonic()))

    def move(self, base_url: str, client: aiohttp.ClientSession) -> aiohttp.ClientSession:
        """Serve from `base_url` with `client` from now on; return the old client to close."""
        old, self.client = self.client, client
        self.route = replace(self.route, base_url=base_url)
        return old

    def mark_up(self) -> None:
        if self.down.done():
            self.down = asyncio.get_running_loop().create_future()
        self.up = True
        self.down_reason = self.back_at_s = None

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, or raise RuntimeDown as soon as this replica goes down."""
        down = self.down
        if down.done():
            discard(awaitable)
            raise RuntimeDown(self.runtime_id, self.down_reason)
        work = await unless(awaitable, down)
        if work is None:
            raise RuntimeDown(self.runtime_id, self.down_reason)
        return work.result()

    def abort(self, rid: str) -> None:
        """Ask the runtime to abort request `rid` (SGLang's `/abort_request`), in the
        background: its slot frees at the scheduler's next step. A batch or `n` > 1 request,
        whose parts SGLang names `rid_0`, `rid_1`, ..., is aborted by the closed connection."""
        task = asyncio.ensure_future(self._abort(rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, rid: str) -> None:
        try:
            async with self.client.post("/abort_request", json={"rid": rid},
                                        timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
                                        ) as reply:
                if reply.status != 200:
                    logger.info("runtime %s did not abort %s: HTTP %d", self.runtime_id, rid,
                                reply.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("runtime %s did not abort %s: %r", self.runtime_id, rid, exc)

    def state(self) -> dict[str, object]:
        state = "up" if self.up else ("restarting" if self.down_reason else "down")
        return {"runtime_id": self.runtime_id, "url": self.route.base_url, "state": state,
                "reason": self.down_reason, "inflight": self.inflight,
                "restarts": self.restarts, "pid": self.pid}

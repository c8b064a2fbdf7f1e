"""`fineslab.router.disconnect._until_left`, the streamed answer's race with its client, on its
own: whoever ends the stream (the body, the client, or Starlette cancelling the response's task
when its own disconnect listener wins), the body is closed where it waits, its clean-up runs to
its end, and no task is left holding an outcome nobody reads (the engine benchmark's runtime
logged "aclose(): asynchronous generator is already running" and "Task exception was never
retrieved" for clients that closed as soon as they had read `[DONE]`)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import anyio

from fineslab.router.disconnect import _until_left


class Body:
    """A streamed body: one chunk, then a wait of `wait_s` (a runtime between tokens), then
    another; notes whether its clean-up ran to its end."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.cleaned = False
        self.cancelled = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(self.wait_s)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            await asyncio.sleep(0)  # a clean-up that awaits (the router's releases its lease)
            self.cleaned = True


def _run(scenario: Any) -> list[dict[str, Any]]:
    """Run `scenario` on a fresh asyncio loop under anyio (as Starlette does); the loop's
    unhandled-exception reports, after a garbage collection."""
    unhandled: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        await scenario()
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0.05)

    anyio.run(main)
    return unhandled


def test_a_response_task_cancelled_mid_wait_closes_the_body_where_it_waits() -> None:
    body, got = Body(wait_s=30.0), list[bytes]()

    async def scenario() -> None:
        left = asyncio.get_running_loop().create_future()

        async def respond() -> None:
            async for chunk in _until_left(body.chunks(), left):
                got.append(chunk)

        async with anyio.create_task_group() as group:  # Starlette's response task group
            group.start_soon(respond)
            await anyio.sleep(0.2)
            group.cancel_scope.cancel()
        assert left.cancelled()

    unhandled = _run(scenario)
    assert got == [b"data: 1\n\n"]
    assert body.cancelled and body.cleaned, "the body's clean-up ran to its end"
    assert unhandled == [], unhandled


def test_a_client_that_leaves_mid_wait_ends_the_stream_and_closes_the_body() -> None:
    body, got = Body(wait_s=30.0), list[bytes]()

    async def scenario() -> None:
        left = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.2, left.set_result, None)
        with anyio.fail_after(5):
            async for chunk in _until_left(body.chunks(), left):
                got.append(chunk)

    unhandled = _run(scenario)
    assert got == [b"data: 1\n\n"]
    assert body.cancelled and body.cleaned
    assert unhandled == [], unhandled


def test_a_body_that_ends_is_relayed_whole_and_stops_the_disconnect_watch() -> None:
    body, got = Body(wait_s=0.01), list[bytes]()
    watch: list[asyncio.Future[None]] = []

    async def scenario() -> None:
        left = asyncio.get_running_loop().create_future()
        watch.append(left)
        async for chunk in _until_left(body.chunks(), left):
            got.append(chunk)

    unhandled = _run(scenario)
    assert got == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert body.cleaned and not body.cancelled
    assert watch[0].cancelled(), "the disconnect watch is stopped with the stream"
    assert unhandled == [], unhandled

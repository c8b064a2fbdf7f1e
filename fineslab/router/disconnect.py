"""A client that goes away takes its request with it.

Neither answer path noticed a client leaving: a non-streamed request waited for its whole answer,
and Starlette's StreamingResponse (ASGI 2.4 servers) learns of a disconnect only when a write
fails, which never comes while a runtime sends nothing. Abandoned requests held their runtime
slots until they finished, or for `upstream_timeout_s` when they could not (issue #35: eight
abandoned requests filled `max_running_requests` and a normal one waited out its SLO for a 429).

`respond` races the router's work with the client's `http.disconnect` (the ASGI message a server
sends once the body is read and the client closes): when the client leaves first, the work is
cancelled wherever it is (queued: it leaves the queue; forwarded: the runtime connection closes
and `proxy.forward` asks the runtime to abort it, freeing its slot). A streamed answer keeps the
race up for every chunk (`_until_left`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

#: nginx's "client closed request": what the router logs for an answer nobody reads.
CLIENT_CLOSED = 499
#: What a streamed answer is made of (Starlette's body iterator).
Chunk = str | bytes | memoryview


async def client_left(request: Request) -> None:
    """Return once the client has gone (or the answer is complete: the server says the same)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, cancelled as soon as the client leaves (then a 499 nobody reads)."""
    left = asyncio.ensure_future(client_left(request))
    answer = asyncio.ensure_future(work)
    racing: set[asyncio.Future[Any]] = {answer, left}
    try:
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        answer.cancel()
        left.cancel()
        raise
    if not answer.done():
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer
        return Response(status_code=CLIENT_CLOSED)
    response = answer.result()
    if isinstance(response, StreamingResponse) and not left.done():
        response.body_iterator = _until_left(response.body_iterator, left)
    else:
        left.cancel()
    return response


async def _until_left(body: AsyncIterable[Chunk], left: asyncio.Future[None]
                      ) -> AsyncIterator[Chunk]:
    """`body`'s chunks until they end or the client leaves; then `body` is closed where it
    waits (its own clean-up releases the runtime)."""
    chunks = aiter(body)
    waiting: asyncio.Future[Chunk] | None = None
    try:
        while True:
            waiting = asyncio.ensure_future(anext(chunks))
            racing: set[asyncio.Future[Any]] = {waiting, left}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                return  # the client left first
            done, waiting = waiting, None
            try:
                chunk = done.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        left.cancel()
        # Starlette cancels this generator where it waits when its own disconnect listener
        # wins (a client that closes as soon as it has read `[DONE]`); the close must still
        # run to its end, under a cancel scope that keeps cancelling every await it makes.
        with anyio.CancelScope(shield=True):
            await _close(chunks, waiting)


async def _close(chunks: AsyncIterator[Chunk], waiting: asyncio.Future[Chunk] | None) -> None:
    """Close the body; `waiting`, a read of it still under way, is cancelled first (the body
    then cleans up where it waits) and awaited, so that no task is left with its outcome."""
    if waiting is not None:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await waiting
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()

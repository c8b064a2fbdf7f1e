"""Forwarding one admitted request to its runtime, streaming or not, with TTFT/TPOT timing.

Non-streaming: one POST, the runtime's status and JSON body are passed back unchanged.
Streaming: the runtime's SSE bytes are passed through as they arrive; TTFT is the time from the
request's arrival at the router to the first event, TPOT the mean gap between later events
(one event is one output token at SGLang's default `stream_interval` of 1).

Every read from the runtime races the replica's `down` future (`Replica.guard`): if the runtime
dies mid-request, a non-streaming client gets a 502 JSON error at once and a streaming client an
SSE `error` event (the `openai` client raises it as an APIError), never a hang.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response, StreamingResponse

from fineslab.router.queues import Lease, ModelQueue
from fineslab.router.replicas import Replica, RuntimeDown

logger = logging.getLogger(__name__)

UPSTREAM_ERRORS = (RuntimeDown, aiohttp.ClientError, TimeoutError)


def error_body(message: str, kind: str, code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "code"}}."""
    return {"error": {"message": message, "type": kind, "code": code}}


def _failure(queue: ModelQueue, lease: Lease, exc: BaseException) -> tuple[str, str]:
    reason = "runtime_down" if isinstance(exc, RuntimeDown) else "runtime_unreachable"
    queue.metrics.failed(queue.route.name, reason)
    message = (str(exc) if isinstance(exc, RuntimeDown)
               else f"runtime {lease.replica.runtime_id} failed: {type(exc).__name__}: {exc}")
    return reason, message


async def _post_whole(replica: Replica, path: str, body: dict[str, Any],
                      ) -> tuple[int, bytes, str]:
    async with replica.client.post(path, json=body) as upstream:
        content = await upstream.read()
        return upstream.status, content, upstream.headers.get("content-type",
                                                              "application/json")


async def forward(queue: ModelQueue, lease: Lease, path: str, body: dict[str, Any],
                  stream: bool) -> Response:
    """Send `body` to the leased replica; releases the lease when the response is done."""
    replica = lease.replica
    if not stream:
        try:
            status, content, media_type = await replica.guard(_post_whole(replica, path, body))
        except UPSTREAM_ERRORS as exc:
            reason, message = _failure(queue, lease, exc)
            return JSONResponse(error_body(message, "runtime_error", reason), status_code=502)
        finally:
            queue.release(lease)
        return Response(content, status_code=status, media_type=media_type)
    try:
        upstream = await replica.guard(replica.client.post(path, json=body))
    except UPSTREAM_ERRORS as exc:
        queue.release(lease)
        reason, message = _failure(queue, lease, exc)
        return JSONResponse(error_body(message, "runtime_error", reason), status_code=502)
    if upstream.status != 200:
        content = await upstream.read()
        upstream.release()
        queue.release(lease)
        return Response(content, status_code=upstream.status,
                        media_type=upstream.headers.get("content-type", "application/json"))
    return StreamingResponse(_relay(queue, lease, upstream), media_type="text/event-stream")


async def _relay(queue: ModelQueue, lease: Lease, upstream: aiohttp.ClientResponse,
                 ) -> AsyncIterator[bytes]:
    model, replica = queue.route.name, lease.replica
    first_s: float | None = None
    last_s = 0.0
    num_events = 0
    chunks = upstream.content.iter_any()
    complete = False
    try:
        while True:
            try:
                chunk = await replica.guard(chunks.__anext__())
            except StopAsyncIteration:
                complete = True
                break
            events = chunk.count(b"data:") - chunk.count(b"data: [DONE]")
            if events > 0:
                last_s = time.monotonic()
                if first_s is None:
                    first_s = last_s
                    queue.metrics.observe_ttft(model, first_s - lease.arrival_s,
                                               queue.route.ttft_slo_s)
                num_events += events
            yield chunk
    except UPSTREAM_ERRORS as exc:
        _, message = _failure(queue, lease, exc)
        event = error_body(message, "runtime_error", 502)
        yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        queue.release(lease)
        if complete:
            upstream.release()  # back to the keep-alive pool
        else:
            upstream.close()
    if first_s is not None and num_events > 1:
        queue.metrics.observe_tpot(model, (last_s - first_s) / (num_events - 1))

"""Forwarding one admitted request to its runtime, streaming or not, with TTFT/TPOT timing.

Non-streaming: one POST, the runtime's status and JSON body are passed back unchanged.
Streaming: the runtime's SSE bytes are passed through as they arrive; TTFT is the time from the
request's arrival at the router to the first event, TPOT the mean gap between later events
(one event is one output token at SGLang's default `stream_interval` of 1).

Every read from the runtime races the replica's `down` event (`Replica.guard`): if the runtime
dies mid-request, a non-streaming client gets a 502 JSON error at once and a streaming client an
SSE `error` event (the `openai` client raises it as an APIError), never a hang.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from fineslab.router.metrics import RouterMetrics
from fineslab.router.queues import Lease, ModelQueue
from fineslab.router.replicas import RuntimeDown

logger = logging.getLogger(__name__)


def error_body(message: str, kind: str, code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "code"}}."""
    return {"error": {"message": message, "type": kind, "code": code}}


def _runtime_failure(queue: ModelQueue, lease: Lease, exc: Exception) -> JSONResponse:
    reason = "runtime_down" if isinstance(exc, RuntimeDown) else "runtime_unreachable"
    queue.metrics.failed(queue.route.name, reason)
    message = (str(exc) if isinstance(exc, RuntimeDown)
               else f"runtime {lease.replica.runtime_id} failed: {type(exc).__name__}: {exc}")
    return JSONResponse(error_body(message, "runtime_error", reason), status_code=502)


async def forward(queue: ModelQueue, lease: Lease, path: str, body: dict[str, Any],
                  stream: bool) -> Response:
    """Send `body` to the leased replica; releases the lease when the response is done."""
    replica = lease.replica
    if not stream:
        try:
            upstream = await replica.guard(replica.client.post(path, json=body))
        except (RuntimeDown, httpx.HTTPError) as exc:
            queue.release(lease)
            return _runtime_failure(queue, lease, exc)
        queue.release(lease)
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"))
    request = replica.client.build_request("POST", path, json=body)
    try:
        upstream = await replica.guard(replica.client.send(request, stream=True))
    except (RuntimeDown, httpx.HTTPError) as exc:
        queue.release(lease)
        return _runtime_failure(queue, lease, exc)
    if upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        queue.release(lease)
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"))
    return StreamingResponse(_relay(queue, lease, upstream), media_type="text/event-stream")


async def _relay(queue: ModelQueue, lease: Lease, upstream: httpx.Response,
                 ) -> AsyncIterator[bytes]:
    model, replica = queue.route.name, lease.replica
    first_s: float | None = None
    last_s = 0.0
    num_events = 0
    chunks = upstream.aiter_raw()
    try:
        while True:
            try:
                chunk = await replica.guard(chunks.__anext__())
            except StopAsyncIteration:
                break
            now_s = time.monotonic()
            events = chunk.count(b"data:") - chunk.count(b"data: [DONE]")
            if events > 0:
                if first_s is None:
                    first_s = now_s
                    queue.metrics.observe_ttft(model, now_s - lease.arrival_s,
                                               queue.route.ttft_slo_s)
                num_events += events
                last_s = now_s
            yield chunk
    except (RuntimeDown, httpx.HTTPError) as exc:
        queue.metrics.failed(model, "runtime_down" if isinstance(exc, RuntimeDown)
                             else "runtime_unreachable")
        message = str(exc) if isinstance(exc, RuntimeDown) else f"runtime stream broke: {exc}"
        event = error_body(message, "runtime_error", 502)
        yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        queue.release(lease)
        await upstream.aclose()
    if first_s is not None and num_events > 1:
        _observe_tpot(queue.metrics, model, (last_s - first_s) / (num_events - 1))


def _observe_tpot(metrics: RouterMetrics, model: str, tpot_s: float) -> None:
    metrics.observe_tpot(model, tpot_s)

"""Forwarding one admitted request to its runtime, streaming or not, with TTFT/TPOT timing.

Non-streaming: one POST; a 200 is passed back unchanged, any other answer of the runtime is
rewritten into the router's error shape (`runtime_error`), its message kept but stripped of
file paths and cut to `MAX_UPSTREAM_MESSAGE` characters, a runtime's 5xx becoming a 502.
Streaming: the runtime's SSE bytes are passed through as they arrive; TTFT is the time from the
request's arrival at the router to the first event, TPOT the mean gap between later events
(one event is one output token at SGLang's default `stream_interval` of 1).

Every read from the runtime races the replica's `down` future (`Replica.guard`): if the runtime
dies mid-request, a non-streaming client gets a 502 JSON error at once and a streaming client an
SSE `error` event (the `openai` client raises it as an APIError), never a hang. When it went
down before the client got any byte, `forward` raises `RuntimeLost` instead, and the router may
send the request again (`app.py`: crash attribution). A runtime that
sends nothing for `upstream_timeout_s` (hung, e.g. SIGSTOPped) fails the request with a 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response, StreamingResponse

from fineslab.router.queues import Lease, ModelQueue
from fineslab.router.replicas import Replica, RuntimeDown
from fineslab.router.routes import ModelRoute, RouterSettings
from fineslab.scheduler.local import ENGINE_DROP_PREFIX

logger = logging.getLogger(__name__)

UPSTREAM_ERRORS = (RuntimeDown, aiohttp.ClientError, TimeoutError)
#: A broken connection is often the first sign of a runtime's death; the supervisor sees the
#: exit within its 0.5 s poll. This long the proxy waits to tell a death from a network error.
DEATH_CONFIRM_S = 1.5


class RuntimeLost(Exception):
    """The runtime went down under a request before any byte of the answer reached the client,
    so the request may be sent again; `response` is the error to give if it is not."""

    def __init__(self, response: Response) -> None:
        super().__init__("runtime lost")
        self.response = response


async def _died(replica: Replica, exc: BaseException) -> bool:
    """Whether `exc` is (or turns out to be, within DEATH_CONFIRM_S) the replica going down."""
    if isinstance(exc, RuntimeDown):
        return True
    if not isinstance(exc, aiohttp.ClientError):
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(replica.down), DEATH_CONFIRM_S)
    return not replica.up
MAX_UPSTREAM_MESSAGE = 400
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.@+-]+){2,}/?")


def error_body(message: str, kind: str, code: str | int | None = None,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "code", "param"}}."""
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


_PYDANTIC_MSG = re.compile(r"""'msg': (['"])(.*?)\1""")


def scrub(message: str) -> str:
    """A runtime's message fit for a client: a pydantic dump cut to its messages, no file
    paths, one line, bounded length."""
    found = [m.group(2) for m in _PYDANTIC_MSG.finditer(message)]
    if found:
        message = "; ".join(found)
    text = " ".join(_PATH.sub("<path>", message).split())
    return text if len(text) <= MAX_UPSTREAM_MESSAGE else text[:MAX_UPSTREAM_MESSAGE] + "..."


def _failure(queue: ModelQueue, lease: Lease, exc: BaseException) -> tuple[int, str, str]:
    """(status, code, message) for a request whose runtime failed it."""
    runtime_id = lease.replica.runtime_id
    if isinstance(exc, RuntimeDown):
        status, reason, message = exc.status, "runtime_down", str(exc)
    elif isinstance(exc, TimeoutError):
        status, reason = 504, "runtime_timeout"
        message = (f"runtime {runtime_id} sent nothing for "
                   f"{queue.settings.upstream_timeout_s:g} s (upstream_timeout_s)")
    else:
        status, reason = 502, "runtime_unreachable"
        message = f"runtime {runtime_id} could not be reached ({type(exc).__name__})"
    queue.metrics.failed(queue.route.name, reason)
    return status, reason, message


async def _failed_before_answer(queue: ModelQueue, lease: Lease,
                                exc: BaseException) -> JSONResponse:
    """The error for a request whose runtime failed before answering; raises RuntimeLost
    (carrying it) when the runtime went down, so that the caller may send it again."""
    code, reason, message = _failure(queue, lease, exc)
    response = JSONResponse(error_body(message, "runtime_error", reason), status_code=code)
    if await _died(lease.replica, exc):
        raise RuntimeLost(response)
    return response


def _error_message(content: bytes) -> str:
    """The message of a runtime's JSON error (SGLang's `{"message"}` / `{"detail"}`, or the
    OpenAI `{"error": {...}}`), also as an SSE event (`data: {...}`); "" when it has none.
    Raises ValueError when `content` is not UTF-8 JSON."""
    text = content.decode().strip()
    if text.startswith("data:"):  # the first event of a stream
        text = text.removeprefix("data:").split("\n", 1)[0].strip()
    parsed = json.loads(text)
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else {}
    return str(inner.get("message") or inner.get("detail") or "") \
        if isinstance(inner, dict) else ""


def drop_response(settings: RouterSettings, message: str) -> JSONResponse:
    """The answer to a request the local scheduler dropped (at the router or in the engine)."""
    return JSONResponse(error_body(message, "slo_drop", settings.drop_status),
                        settings.drop_status, headers={"Retry-After": str(settings.retry_after_s)})


def upstream_error(status: int, content: bytes) -> JSONResponse:
    """A runtime's non-200 answer in the router's shape (its 4xx kept, its 5xx -> 502)."""
    try:
        message = _error_message(content)
    except ValueError:
        message = content[:MAX_UPSTREAM_MESSAGE].decode(errors="replace")
    message = scrub(message) or f"the runtime answered {status}"
    if status >= 500:
        return JSONResponse(error_body(f"the runtime failed the request: {message}",
                                       "runtime_error", "runtime_failed"), 502)
    return JSONResponse(error_body(message, "invalid_request_error", "runtime_rejected"),
                        status)


def runtime_body(body: dict[str, Any], route: ModelRoute, lease: Lease,
                 wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The body sent to the runtime: the client's, without its `priority` (SGLang's scheduling
    field is the router's to set) and its null fields (unset, in the OpenAI API), and with the
    request's TTFT deadline in it (wall-clock milliseconds) when the runtimes schedule by
    deadline (`ModelRoute.engine_deadlines`); its `rid` is the router's own, unique, to abort
    the request by when its client leaves (a client's rid could name another client's
    request)."""
    # null is "unset" in the OpenAI API; SGLang's models refuse it for fields such as
    # max_tokens ("Input should be a valid integer"): an unset field takes SGLang's default
    sent = {key: value for key, value in body.items()
            if key not in ("priority", "rid") and value is not None}
    sent["rid"] = f"fineslab-{uuid.uuid4().hex}"  # the router's, to abort it by (never a client's)
    if route.engine_deadlines:
        deadline_s = wall() + (lease.arrival_s + route.ttft_slo_s - monotonic())
        sent["priority"] = int(deadline_s * 1000)
    return sent


def engine_dropped(queue: ModelQueue, content: bytes) -> Response | None:
    """The router's drop answer when `content` (a runtime's 429, or the first event of its
    stream) is the engine policy's drop; None otherwise."""
    if ENGINE_DROP_PREFIX.encode() not in content:
        return None
    message = ""
    with contextlib.suppress(ValueError):
        message = _error_message(content)
    if not message.startswith(ENGINE_DROP_PREFIX):
        message = f"{ENGINE_DROP_PREFIX}: it cannot get its first token by its deadline"
    queue.metrics.dropped(queue.route.name, "engine")
    return drop_response(queue.settings, f"model {queue.route.name} is overloaded: "
                                         f"{scrub(message)}; retry later")


async def _post_whole(replica: Replica, path: str, body: dict[str, Any],
                      ) -> tuple[int, bytes, str]:
    async with replica.client.post(path, json=body) as upstream:
        content = await upstream.read()
        return upstream.status, content, upstream.headers.get("content-type",
                                                              "application/json")


async def forward(queue: ModelQueue, lease: Lease, path: str, body: dict[str, Any],
                  stream: bool) -> Response:
    """Send `body` to the leased replica; releases the lease when the response is done.

    Raises RuntimeLost when the runtime went down before the client got anything.
    """
    replica = lease.replica
    if not stream:
        try:
            status, content, media_type = await replica.guard(_post_whole(replica, path, body))
        except UPSTREAM_ERRORS as exc:
            queue.release(lease)
            return await _failed_before_answer(queue, lease, exc)
        except asyncio.CancelledError:  # the client left (disconnect.py)
            abandon(queue, lease, body)
            raise
        queue.release(lease)
        if status != 200:
            if status == 429 and (dropped := engine_dropped(queue, content)) is not None:
                return dropped
            return upstream_error(status, content)
        return Response(content, status_code=status, media_type=media_type)
    try:
        upstream = await replica.guard(replica.client.post(path, json=body))
    except UPSTREAM_ERRORS as exc:
        queue.release(lease)
        return await _failed_before_answer(queue, lease, exc)
    except asyncio.CancelledError:
        abandon(queue, lease, body)
        raise
    if upstream.status != 200:
        try:
            content = await replica.guard(upstream.read())
        except UPSTREAM_ERRORS:
            content = b""
        finally:
            upstream.release()
            queue.release(lease)
        return upstream_error(upstream.status, content)
    first = b""
    if queue.route.engine_deadlines:
        # The engine may still drop it before prefill: hold the head until the first event so
        # that such a drop is a 429, not a 200 whose stream holds an error.
        try:
            first = await replica.guard(upstream.content.readuntil(b"\n\n"))
        except UPSTREAM_ERRORS as exc:
            upstream.close()
            queue.release(lease)
            return await _failed_before_answer(queue, lease, exc)
        except ValueError:  # an event longer than aiohttp's line limit: relay as it comes
            first = b""
        except asyncio.CancelledError:
            upstream.close()
            abandon(queue, lease, body)
            raise
        if (dropped := engine_dropped(queue, first)) is not None:
            upstream.close()
            queue.release(lease)
            return dropped
    return StreamingResponse(_relay(queue, lease, upstream, first, body.get("rid")),
                             media_type="text/event-stream")


def abandon(queue: ModelQueue, lease: Lease, body: dict[str, Any]) -> None:
    """The client left mid-request: free its slot here, and ask the runtime to abort it (the
    closed connection alone reaches SGLang only at its next check, up to 4 s later)."""
    queue.release(lease, served=False)
    rid = body.get("rid")
    if isinstance(rid, str):
        lease.replica.abort(rid)


async def _relay(queue: ModelQueue, lease: Lease, upstream: aiohttp.ClientResponse,
                 first: bytes = b"", rid: str | None = None) -> AsyncIterator[bytes]:
    """Pass the stream through (`first`: what `forward` already read of it)."""
    model, replica = queue.route.name, lease.replica
    first_s: float | None = None
    last_s = 0.0
    num_events = 0
    chunks = upstream.content.iter_any()
    complete = False  # the runtime's stream ended
    answered = False  # the client has the whole answer (`[DONE]`), if not yet its end
    try:
        while True:
            if first:
                chunk, first = first, b""
            else:
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
                    queue.first_token(lease, first_s)
                num_events += events
            answered = answered or b"data: [DONE]" in chunk
            yield chunk
    except UPSTREAM_ERRORS as exc:
        _status, reason, message = _failure(queue, lease, exc)
        event = error_body(message, "runtime_error", reason)
        yield f"data: {json.dumps(event)}\n\n".encode()
    except (asyncio.CancelledError, GeneratorExit):  # the client left (disconnect.py)
        if not complete and not answered:  # a client that closes after `[DONE]` was served
            queue.release(lease, served=False)
            queue.metrics.abandoned(model)
            if rid is not None:
                replica.abort(rid)
        raise
    finally:
        queue.release(lease)
        if complete:
            upstream.release()  # back to the keep-alive pool
        else:
            upstream.close()
    if first_s is not None and num_events > 1:
        queue.metrics.observe_tpot(model, (last_s - first_s) / (num_events - 1))

"""The front router: the one OpenAI API of a multi-node fleet, a thin proxy to node routers.

    client --> front router --(by `model`)--> node router "a" --> runtimes of node a
                            \\-------------> node router "b" --> runtimes of node b

Here: the settings, the route table, and FrontRouter's forwarding and SSE relay. front_app.py
holds the HTTP app on top (endpoints, status codes), its uvicorn thread and the merged /metrics.

The front does no scheduling: it picks, among the live nodes that serve the request's model,
the one with the fewest requests in flight through the front, and forwards the raw body bytes
(never re-serialized). The node's answer comes back unchanged (status, body, content type,
Retry-After), SSE events relayed as they arrive (cut at event boundaries, so that an error
event never lands inside a half-sent one).

The cluster driver calls `set_routes`, `mark_node_lost`, `mark_moving` and `state` from its own
threads. The route table sits under one lock (held for microseconds, never across an await);
ending the requests of a lost node hops onto the app's loop. Invariants, under the lock:

    every node in routes[model] is in links, up, once
    link.inflight == requests picked at that link and not yet finished  (>= 0)
    moving ⊆ routes (every model ever named stays in routes: 503, never 404)
    a model is served  <=>  routes[model] != [] and model not in moving
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fineslab.connections import pooled_connector
from fineslab.errors import ConfigError, IntegrityError
from fineslab.router.app import INLINE_PARSE_BYTES, bad_request
from fineslab.router.disconnect import CLIENT_CLOSED
from fineslab.router.metrics import LATENCY_BUCKETS_S
from fineslab.router.proxy import error_body
from fineslab.router.replicas import discard, unless
from fineslab.router.requests import parse_body
from fineslab.router.validation import BadRequest

logger = logging.getLogger(__name__)
T = TypeVar("T")

NODE_CONNECT_TIMEOUT_S = 10.0
#: Response headers of a node router that reach the client (status, body and type always do).
PASSED_HEADERS = ("retry-after",)


class NodeLost(Exception):
    """The node serving a request was marked lost before the request finished."""


UPSTREAM_ERRORS = (NodeLost, aiohttp.ClientError, TimeoutError)


@dataclass(frozen=True)
class FrontSettings:
    """The front's behaviour (the fleet config's `cluster:` section gives it)."""

    api_key: str | None = None
    #: Larger request bodies are refused with 413 before they are read whole.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Longest wait for a node's next bytes (head or stream chunk) before a 504.
    upstream_timeout_s: float = 600.0
    #: Retry-After of a 503 while a model has no live node.
    retry_after_s: int = 1
    #: Bearer key the front sends to the node routers (None: none).
    node_api_key: str | None = None

    def __post_init__(self) -> None:
        if self.upstream_timeout_s <= 0 or self.max_body_bytes < 1024 or self.retry_after_s < 1:
            raise ConfigError("upstream_timeout_s must be positive, max_body_bytes >= 1024 and "
                              "retry_after_s >= 1")


class NodeLink:
    """One node router at one URL. A node that comes back (or moves) is a new link, so the
    `lost` future of the old one stays resolved for the requests still holding it."""

    def __init__(self, node: str, base_url: str) -> None:
        self.node, self.base_url = node, base_url
        self.up = True
        self.lost_reason: str | None = None
        self.inflight = 0
        self.served = 0
        self._lost: asyncio.Future[None] | None = None  # created and resolved on the loop

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, or raise NodeLost as soon as this link is marked lost."""
        if not self.up:
            discard(awaitable)
            raise NodeLost
        if self._lost is None:
            self._lost = asyncio.get_running_loop().create_future()
        work = await unless(awaitable, self._lost)
        if work is None:
            raise NodeLost
        return work.result()

    def end_requests(self) -> None:
        """Wake every guard of this link (on the loop, after `up` went False)."""
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def state(self) -> dict[str, Any]:
        return {"url": self.base_url, "state": "up" if self.up else "lost",
                "reason": self.lost_reason, "inflight": self.inflight, "served": self.served}


class FrontRouter:
    """The route table (any thread) and the requests through it (the app's loop)."""

    def __init__(self, settings: FrontSettings) -> None:
        self.settings = settings
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._links: dict[str, NodeLink] = {}  # node -> its current link (lost ones kept)
        self._retired: list[NodeLink] = []  # links replaced while requests were at them
        self._routes: dict[str, list[str]] = {}  # every model ever named -> its live nodes
        self._moving: dict[str, tuple[str, int]] = {}  # model -> (503 message, Retry-After)
        self._session: aiohttp.ClientSession | None = None
        self.registry = CollectorRegistry()
        self._requests = Counter("fineslab_front_requests", "Requests through the front",
                                 ["model", "node", "status"], registry=self.registry)
        self._seconds = Histogram("fineslab_front_request_seconds",
                                  "Front arrival to the answer's last byte", ["model", "node"],
                                  buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.scrape_errors = Counter("fineslab_front_scrape_errors",
                                     "Node /metrics scrapes that failed", ["node"],
                                     registry=self.registry)

    # -- the route table (any thread) -----------------------------------------------------------

    def set_routes(self, routes: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        """Replace the table: model -> [(node, node router base URL)]. A model left out is
        still served (503 until a table names it again)."""
        urls: dict[str, str] = {}
        for model, pairs in routes.items():
            for node, url in pairs:
                if urls.setdefault(node, url.rstrip("/")) != url.rstrip("/"):
                    raise ConfigError(f"node {node} has two URLs in one table ({model})")
        with self._lock:
            links: dict[str, NodeLink] = {n: k for n, k in self._links.items()
                                          if not k.up and n not in urls}  # lost: kept on show
            for node, url in urls.items():
                old = self._links.get(node)
                links[node] = old if old and old.up and old.base_url == url else \
                    NodeLink(node, url)
            replaced = [k for k in self._links.values() if links.get(k.node) is not k]
            self._retired = [k for k in self._retired + replaced if k.inflight and k.up]
            self._links = links
            for model in routes:
                self._routes[model] = list(dict.fromkeys(n for n, _ in routes[model]))
            for model in self._routes:
                if model not in routes:
                    self._routes[model] = []
                elif self._routes[model]:
                    self._moving.pop(model, None)

    def mark_node_lost(self, node: str, reason: str) -> None:
        """The node is gone: its requests end now, its routes are dropped."""
        with self._lock:
            links = [k for k in (self._links.get(node), *self._retired)
                     if k is not None and k.node == node and k.up]
            for link in links:
                link.up, link.lost_reason = False, reason
            self._retired = [k for k in self._retired if k.up]
            for model, nodes in self._routes.items():
                if node in nodes:
                    nodes.remove(node)
                    if not nodes:
                        self._moving[model] = (
                            f"model {model} is being re-placed after node {node} was lost "
                            f"({reason})", self.settings.retry_after_s)
        loop = self.loop
        if loop is not None and links:
            with contextlib.suppress(RuntimeError):  # the loop closed: no request is left
                loop.call_soon_threadsafe(self._end_requests, node, reason, links)

    def _end_requests(self, node: str, reason: str, links: list[NodeLink]) -> None:
        logger.info("node %s lost (%s): ended %d in-flight request(s)", node, reason,
                    sum(k.inflight for k in links))
        for link in links:
            link.end_requests()

    def mark_moving(self, models: Iterable[str], retry_after_s: int | None = None) -> None:
        """These models are being (re)started somewhere: 503 until `set_routes` names them."""
        retry_s = retry_after_s or self.settings.retry_after_s
        with self._lock:
            for model in models:
                self._routes.setdefault(model, [])
                self._moving[model] = (f"model {model} is being moved to another node", retry_s)

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"nodes": {n: k.state() for n, k in self._links.items()},
                    "models": {m: {"nodes": list(nodes), "moving": m in self._moving}
                               for m, nodes in self._routes.items()}}

    def live_links(self) -> list[NodeLink]:
        """The links up now, for scraping their /metrics (a snapshot: the table moves on)."""
        with self._lock:
            return [k for k in self._links.values() if k.up]

    def served_models(self) -> dict[str, list[str]]:
        """Every model the front serves (moving ones included) -> its live nodes."""
        with self._lock:
            return {m: [] if m in self._moving else list(nodes)
                    for m, nodes in self._routes.items()}

    def check_integrity(self) -> None:
        """IntegrityError unless the invariants of the module docstring hold."""
        with self._lock:
            for model, nodes in self._routes.items():
                dead = [n for n in nodes if n not in self._links or not self._links[n].up]
                if dead or len(set(nodes)) != len(nodes):
                    raise IntegrityError(f"model {model} routed to {nodes}; not up: {dead}")
            for link in (*self._links.values(), *self._retired):
                if link.inflight < 0:
                    raise IntegrityError(f"node {link.node}: {link.inflight} in flight")
            if set(self._moving) - set(self._routes):
                raise IntegrityError(f"moving but unknown: {set(self._moving) - set(self._routes)}")

    def _choose(self, model: str) -> NodeLink | JSONResponse:
        """The live node with the fewest requests in flight, counted in; or the error."""
        with self._lock:
            nodes = self._routes.get(model)
            if nodes is None:
                served = sorted(self._routes)
                return JSONResponse(error_body(
                    f"model {model!r:.80} is not served by this fleet; it serves {served}",
                    "invalid_request_error", "model_not_found", "model"), 404)
            live = [self._links[n] for n in nodes if self._links[n].up]
            message, retry_s = self._moving.get(model, (
                f"model {model} has no live node now", self.settings.retry_after_s))
            if model in self._moving or not live:
                return JSONResponse(error_body(message, "node_unavailable", "model_moving"),
                                    503, headers={"Retry-After": str(retry_s)})
            link = min(live, key=lambda k: (k.inflight, k.served))
            link.inflight += 1
            return link

    def _finish(self, link: NodeLink, model: str, arrival_s: float, status: int) -> None:
        with self._lock:
            link.inflight -= 1
            link.served += 1
        self._requests.labels(model, link.node, str(status)).inc()
        self._seconds.labels(model, link.node).observe(time.monotonic() - arrival_s)

    # -- lifecycle and requests (on the loop) ---------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=NODE_CONNECT_TIMEOUT_S,
                                        sock_read=self.settings.upstream_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout,
                                              connector=pooled_connector())

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client session to the node routers (open between start() and stop())."""
        assert self._session is not None, "requests arrive only after start()"
        return self._session

    async def stop(self) -> None:
        self.loop = None
        if self._session is not None:
            await self._session.close()

    async def handle(self, raw: bytes, path: str, content_type: str | None) -> Response:
        arrival_s = time.monotonic()
        try:
            if len(raw) <= INLINE_PARSE_BYTES:
                model = parse_body(raw)["model"]
            else:
                model = (await asyncio.to_thread(parse_body, raw))["model"]
        except BadRequest as exc:
            return bad_request(exc)
        link = self._choose(model)
        if isinstance(link, JSONResponse):
            if link.status_code == 503:  # a known model: no label from a client's whim
                self._requests.labels(model, "", "503").inc()
            return link
        exchange = _Exchange(self, link, model, arrival_s)
        try:
            return await self._forward(exchange, raw, path, content_type)
        except asyncio.CancelledError:  # the client left (router/disconnect.py)
            exchange.finish(CLIENT_CLOSED)
            raise
        except BaseException:
            exchange.finish(500)  # a defect: the link is released all the same
            raise

    async def _forward(self, exchange: _Exchange, raw: bytes, path: str,
                       content_type: str | None) -> Response:
        link = exchange.link
        headers = {"Content-Type": content_type or "application/json"}
        if self.settings.node_api_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.node_api_key}"
        try:
            upstream = await link.guard(self.session.post(link.base_url + path, data=raw,
                                                          headers=headers))
        except UPSTREAM_ERRORS as exc:
            return exchange.fail(exc)
        passed = {h: upstream.headers[h] for h in PASSED_HEADERS if h in upstream.headers}
        media_type = upstream.headers.get("content-type", "application/json")
        if media_type.startswith("text/event-stream"):
            return _RelayResponse(exchange, upstream, passed, media_type)
        try:
            content = await link.guard(upstream.read())
        except UPSTREAM_ERRORS as exc:
            return exchange.fail(exc)
        finally:
            upstream.release()  # a half-read connection is closed, not pooled
        exchange.finish(upstream.status)
        return Response(content, upstream.status, headers=passed, media_type=media_type)


class _Exchange:
    """One request at one node: finished (link released, metrics recorded) exactly once."""

    def __init__(self, front: FrontRouter, link: NodeLink, model: str, arrival_s: float) -> None:
        self.front, self.link, self.model, self.arrival_s = front, link, model, arrival_s
        self.finished = False

    def finish(self, status: int) -> None:
        if not self.finished:
            self.finished = True
            self.front._finish(self.link, self.model, self.arrival_s, status)

    def failure(self, exc: BaseException) -> tuple[int, dict[str, Any]]:
        """(status, error body) for a request its node failed."""
        link = self.link
        if isinstance(exc, NodeLost) or not link.up:
            status, code = 502, "node_lost"
            message = f"node {link.node} was lost while serving this request ({link.lost_reason})"
        elif isinstance(exc, TimeoutError):
            status, code = 504, "node_timeout"
            message = (f"node {link.node} sent nothing for "
                       f"{self.front.settings.upstream_timeout_s:g} s (upstream_timeout_s)")
        else:
            status, code = 502, "node_unreachable"
            message = f"node {link.node} could not be reached ({type(exc).__name__})"
        self.finish(status)
        return status, error_body(message, "node_error", code)

    def fail(self, exc: BaseException) -> JSONResponse:
        status, body = self.failure(exc)
        return JSONResponse(body, status)


class _RelayResponse(StreamingResponse):
    """A node's SSE stream, relayed whole events at a time; the exchange is finished even when
    the client leaves before the first byte (Starlette then never starts the iterator)."""

    def __init__(self, exchange: _Exchange, upstream: aiohttp.ClientResponse,
                 headers: dict[str, str], media_type: str) -> None:
        super().__init__(self._relay(), upstream.status, headers, media_type)
        self.exchange, self.upstream = exchange, upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.upstream.close()
            self.exchange.finish(self.upstream.status)

    async def _relay(self) -> AsyncIterator[bytes]:
        link, chunks = self.exchange.link, self.upstream.content.iter_any()
        pending = b""
        try:
            while True:
                try:
                    pending += await link.guard(chunks.__anext__())
                except StopAsyncIteration:
                    break
                cut = max(pending.rfind(b"\n\n") + 2, pending.rfind(b"\r\n\r\n") + 4)
                if cut > 1:
                    out, pending = pending[:cut], pending[cut:]
                    yield out
            self.upstream.release()
            self.exchange.finish(self.upstream.status)
            if pending:
                yield pending
        except UPSTREAM_ERRORS as exc:
            _status, body = self.exchange.failure(exc)
            yield f"event: error\ndata: {json.dumps(body)}\n\n".encode()


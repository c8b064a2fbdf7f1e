"""The front router's HTTP face: the FastAPI app, its uvicorn thread, and the merged /metrics.

    POST /v1/completions, /v1/chat/completions   raw body to FrontRouter.handle, answer passed back
    GET  /v1/models, /health, /health/{model}, /metrics, /admin/nodes

Status codes of the front's own: 400 body not a JSON object or no string `model`, 401 missing or
wrong API key, 404 model no route ever named (or unknown path), 405 wrong method, 413 body over
`max_body_bytes`, 502 `node_unreachable` (no connection before any byte) or `node_lost`
(`mark_node_lost` under the request; an SSE `error` event once the stream began), 503 +
Retry-After while the model has no live node (lost or `mark_moving`), 504 `node_timeout` when
the node sends nothing for `upstream_timeout_s`. Every error has the node router's shape
`{"error": {"message", "type", "code", "param"}}`, no path, no traceback; a defect is logged and
answered 500 in that shape.

/metrics is the front's own registry, then every live node router's /metrics scraped at once,
each sample labelled `node`. It is best effort: a node that fails a scrape is left out (counted
in fineslab_front_scrape_errors, warned about at most every SCRAPE_WARN_EVERY_S), and a defect
in the merging leaves the front's own metrics.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse, Response

from fineslab.cluster.front import FrontRouter, NodeLink
from fineslab.router.admin import UNAUTHORIZED, authorized, authorized_body
from fineslab.router.disconnect import respond
from fineslab.router.http import guarded, install_error_handlers
from fineslab.router.proxy import error_body
from fineslab.router.server import AppServer

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
#: A node whose /metrics keeps failing is warned about this often, not at every scrape.
SCRAPE_WARN_EVERY_S = 60.0
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeMetrics:
    """The front's /metrics with every live node router's merged in (on the app's loop).
    It adds the per-node gauges to the front's registry, so one front has one NodeMetrics."""

    def __init__(self, front: FrontRouter) -> None:
        self.front = front
        self._warned_at: dict[str, float] = {}
        front.registry.register(_NodeCollector(front))

    async def exposition(self) -> bytes:
        """The front's metrics, then every live node router's, each sample labelled `node`."""
        links = self.front.live_links()
        texts = await asyncio.gather(*(self._scrape(k) for k in links))
        families: dict[str, Metric] = {}
        for link, text in zip(links, texts, strict=True):
            try:
                parsed = list(text_string_to_metric_families(text)) if text is not None else None
            except ValueError as exc:
                parsed = None
                self._scrape_failed(link, f"unparsable ({exc})")
            for family in parsed or ():
                merged = families.setdefault(family.name, Metric(family.name,
                                                                 family.documentation,
                                                                 family.type))
                merged.samples.extend(s._replace(labels={**s.labels, "node": link.node})
                                      for s in family.samples)
        return generate_latest(self.front.registry) + generate_latest(_Families(families))

    async def _scrape(self, link: NodeLink) -> str | None:
        session, node_api_key = self.front.session, self.front.settings.node_api_key
        headers = ({"Authorization": f"Bearer {node_api_key}"}
                   if node_api_key is not None else None)
        try:
            async with session.get(link.base_url + "/metrics", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S),
                                   ) as reply:
                if reply.status == 200:
                    return await reply.text()
                why = f"status {reply.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = type(exc).__name__
        self._scrape_failed(link, why)
        return None

    def _scrape_failed(self, link: NodeLink, why: str) -> None:
        self.front.scrape_errors.labels(link.node).inc()
        now = time.monotonic()
        if now - self._warned_at.get(link.node, -SCRAPE_WARN_EVERY_S) >= SCRAPE_WARN_EVERY_S:
            self._warned_at[link.node] = now
            logger.warning("metrics of node %s (%s) skipped: %s (warned at most every %.0f s)",
                           link.node, link.base_url, why, SCRAPE_WARN_EVERY_S)


class _NodeCollector(Collector):
    """fineslab_front_node_up{node} and fineslab_front_inflight{node}, at scrape time."""

    def __init__(self, front: FrontRouter) -> None:
        self.front = front

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("fineslab_front_node_up", "1 while the node router is serving",
                               labels=["node"])
        inflight = GaugeMetricFamily("fineslab_front_inflight",
                                     "Requests in flight through the front", labels=["node"])
        for node, link in self.front.state()["nodes"].items():
            up.add_metric([node], 1.0 if link["state"] == "up" else 0.0)
            inflight.add_metric([node], link["inflight"])
        yield from (up, inflight)


class _Families(Collector):
    def __init__(self, families: dict[str, Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()


def create_front_app(front: FrontRouter) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await front.start()
        yield
        await front.stop()

    app = FastAPI(title="fineslab front router", lifespan=lifespan)
    api_key = front.settings.api_key
    node_metrics = NodeMetrics(front)

    async def serve(request: Request, path: str) -> Response:
        raw = await authorized_body(request, api_key, front.settings.max_body_bytes)
        if isinstance(raw, Response):
            return raw
        return await respond(request, guarded(front.handle(raw, path,
                                                           request.headers.get("content-type"))))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        if not authorized(request, api_key):
            return JSONResponse(UNAUTHORIZED, 401)
        data = [{"id": m, "object": "model", "owned_by": "fineslab", "nodes": nodes}
                for m, nodes in front.served_models().items()]
        return JSONResponse({"object": "list", "data": data})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        models = front.served_models()
        without = sorted(m for m, nodes in models.items() if not nodes)
        ok = bool(models) and not without  # a front with no route yet serves nothing
        status = "ok" if ok else ("degraded" if models else "no_routes")
        return JSONResponse({"status": status, "models": models,
                             "without_node": without}, 200 if ok else 503)

    @app.api_route("/health/{model}", methods=["GET", "HEAD"])
    async def model_health(model: str) -> Response:
        nodes = front.served_models().get(model)
        if nodes is None:
            return JSONResponse(error_body(f"model {model!r:.80} is not served by this fleet",
                                           "invalid_request_error", "model_not_found"), 404)
        return JSONResponse({"model": model, "status": "ok" if nodes else "moving",
                             "nodes": nodes}, 200 if nodes else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(await _guarded_bytes(node_metrics.exposition()),
                        media_type=METRICS_TYPE)

    @app.get("/admin/nodes")
    async def admin_nodes(request: Request) -> Response:
        if not authorized(request, api_key):
            return JSONResponse(UNAUTHORIZED, 401)
        return JSONResponse(front.state())

    install_error_handlers(app)
    return app


async def _guarded_bytes(work: Awaitable[bytes]) -> bytes:
    """The node metrics are best effort: a defect in merging them leaves the front's own."""
    try:
        return await work
    except Exception:
        logger.exception("merging the node routers' metrics failed (a defect; please report it)")
        return b""


class FrontServer(AppServer):
    """The front's uvicorn in a background thread (router.server.AppServer)."""

    def __init__(self, front: FrontRouter, host: str = "127.0.0.1", port: int = 0,
                 sock: socket.socket | None = None, log_level: str = "warning") -> None:
        super().__init__(create_front_app(front), host, port, log_level, sock, "front router")
        self.front = front

"""The router's HTTP face: an OpenAI-compatible FastAPI app in front of the runtimes of one node.

    POST /v1/completions, /v1/chat/completions   (stream: true -> SSE)
    GET  /v1/models, /health, /metrics

    GET  /health/{model}   one model: 200 while it has a live runtime, else 503

    GET  /admin/models, /admin/arenas, POST /admin/models/{model}/sleep|wake|limit
         the admin API behind `fineslab ctl` and `fineslab top` (admin.py)

Status codes: 400 malformed body, out-of-range field or over-long prompt (validation.py),
401 missing/wrong API key, 404 unknown model or path, 405 wrong method, 413 body over
`max_body_bytes`, 429/503 + Retry-After when the local scheduler drops a request
(`on_drop: reject`), 502 when the runtime dies or cannot be reached while serving it, 504 when
it sends nothing for `upstream_timeout_s`. Every error, whoever raised it (the router, FastAPI,
a runtime), has one shape: `{"error": {"message", "type", "code", "param"}}`, with no internal
path or traceback; an unexpected exception is logged here and answered 500 in that shape.

`Router` (app.py) holds the live state and answers each request; `create_app(router)` wires it
into FastAPI; `guarded` and `install_error_handlers` give every error the one shape (the cluster's
front router uses them too).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from fineslab.router.admin import UNAUTHORIZED, authorized, authorized_body, install_admin
from fineslab.router.app import Router
from fineslab.router.disconnect import respond
from fineslab.router.proxy import error_body

logger = logging.getLogger(__name__)


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="fineslab router", lifespan=lifespan)

    async def serve(request: Request, path: str, chat: bool) -> Response:
        raw = await authorized_body(request, router.settings.api_key,
                                    router.settings.max_body_bytes)
        if isinstance(raw, Response):
            return raw
        return await respond(request, guarded(router.handle(raw, path, chat)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions", chat=True)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        if not authorized(request, router.settings.api_key):
            return JSONResponse(UNAUTHORIZED, 401)
        data = [{"id": name, "object": "model", "owned_by": "fineslab",
                 "max_model_len": route.context_tokens} for name, route in router.routes.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        serving, body = router.health()
        return JSONResponse(body, 200 if serving else 503)

    @app.api_route("/health/{model}", methods=["GET", "HEAD"])
    async def model_health(model: str) -> Response:
        status, body = router.model_health(model)
        return JSONResponse(body, status)

    install_admin(app, router)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(router.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    install_error_handlers(app)
    return app


async def guarded(work: Awaitable[Response]) -> Response:
    """A defect in the router answers 500 in the OpenAI shape and keeps the connection."""
    try:
        return await work
    except Exception:
        logger.exception("the router failed a request (a defect; please report it)")
        return JSONResponse(error_body("internal error in the router; it is logged there",
                                       "internal_error", "internal_error"), 500)


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors (unknown path, wrong method, ...) in the one error shape."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
                       exc.status_code, str(exc.detail))
        return JSONResponse(error_body(message, "invalid_request_error", kind),
                            exc.status_code, headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body("the request does not match the endpoint",
                                       "invalid_request_error", "invalid_request"), 400)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)

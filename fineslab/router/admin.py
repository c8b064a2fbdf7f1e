"""The router's admin API: what `fineslab ctl` and `fineslab top` call.

    GET  /admin/models               every model: state, idle time, weight slabs, KV limit
    GET  /admin/arenas               each device's slab table (what `fineslab top` shows)
    POST /admin/models/{model}/sleep put an elastic model to sleep now (409 while it is busy)
    POST /admin/models/{model}/wake  wake it now (503 + Retry-After when nothing makes room)
    POST /admin/models/{model}/limit {"kv_bytes": N | null}: cap the KV each of its runtimes
                                     may hold in the arena (null lifts the cap)

All behind the API key when one is set. A KV limit is mechanism in the slab table
(`SlabTable.set_kv_limit`): kept by runtime id, so a restarted runtime keeps it; enforced
where slabs are carved, so SGLang sees it as a smaller pool (it queues or retracts, as when
the arena is full). Lowering a limit below what a runtime holds takes nothing back: it refuses
new slabs until use drops under it. Refused: a limit below one slab (the model could hold no
KV at all and its requests would wait for their deadlines), a model whose KV is not in the
arena (`kv_pool: sglang`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from fineslab.router.elastic import CannotWake, NotElastic
from fineslab.router.proxy import error_body
from fineslab.slabs.inspector import as_dict
from fineslab.slabs.limits import MAX_KV_LIMIT

if TYPE_CHECKING:
    from fineslab.router.app import Router

#: The limit call's body is a few bytes; anything longer is not one.
LIMIT_BODY_BYTES = 4096


class BadLimit(ValueError):
    pass


def authorized(request: Request, api_key: str | None) -> bool:
    if api_key is None:
        return True
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    return hmac.compare_digest(token.encode(), api_key.encode())


def parse_limit(raw: bytes) -> int | None:
    """The `kv_bytes` of a limit call's body; BadLimit with the reason."""
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        raise BadLimit("the body is not JSON: send {\"kv_bytes\": N} or {\"kv_bytes\": null}"
                       ) from None
    if not isinstance(body, dict) or "kv_bytes" not in body:
        raise BadLimit("the body must be {\"kv_bytes\": N} (bytes) or {\"kv_bytes\": null}")
    value = body["kv_bytes"]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadLimit(f"kv_bytes must be a whole number of bytes >= 0 or null, not {value!r:.40}")
    if value > MAX_KV_LIMIT:
        raise BadLimit(f"kv_bytes must be at most {MAX_KV_LIMIT} (2^63 - 1), not {value!r:.40}: "
                       "send null for no limit")
    return value


def model_limits(router: Router, model: str) -> dict[str, int | None]:
    """Runtime id -> KV limit of each runtime of `model` (empty without an arena)."""
    limits = router.kv_limits
    if limits is None:
        return {}
    return {r.runtime_id: limits.get(r.runtime_id) for r in router.routes[model].replicas}


def install_admin(app: FastAPI, router: Router) -> None:
    unauthorized = error_body("missing or wrong API key (Authorization: Bearer ...)",
                              "authentication_error", "invalid_api_key")

    def refused(message: str, code: str, status: int) -> JSONResponse:
        return JSONResponse(error_body(message, "invalid_request_error", code), status)

    @app.get("/admin/models")
    async def admin_models(request: Request) -> Response:
        if not authorized(request, router.settings.api_key):
            return JSONResponse(unauthorized, 401)
        elastic = router.elastic.describe() if router.elastic is not None else []
        listed = {m["model"] for m in elastic}
        fixed = [{"model": name, "state": "serving", "elastic": False}
                 for name in router.routes if name not in listed]
        models = [{**m, "elastic": True} for m in elastic] + fixed
        streams = router.stream_states()
        for m in models:
            m["state"] = router.live_state(m["model"])  # `restarting` while no runtime is up
            m["kv_limits"] = model_limits(router, m["model"])
            mine = {runtime: state for (model, runtime), state in streams.items()
                    if model == m["model"]}
            if mine:
                m["streaming"] = {runtime: {
                    "layers": state.layers, "lent_bytes": state.net_lent_bytes,
                    "streamed_bytes": state.streamed_bytes,
                    "streamed_bytes_last_step": state.streamed_bytes_last_pass,
                    "decode_compute_s": state.decode_compute_s,
                    "error": state.error} for runtime, state in mine.items()}
        return JSONResponse({"models": models})

    @app.get("/admin/arenas")
    async def admin_arenas(request: Request) -> Response:
        if not authorized(request, router.settings.api_key):
            return JSONResponse(unauthorized, 401)
        return JSONResponse({"arenas": {device: as_dict(snap)
                                        for device, snap in router.slabs().items()}})

    @app.post("/admin/models/{model}/{action}")
    async def admin_action(model: str, action: str, request: Request) -> Response:
        if not authorized(request, router.settings.api_key):
            return JSONResponse(unauthorized, 401)
        if action not in ("sleep", "wake", "limit"):
            return refused(f"no such action {action!r:.40}: sleep, wake or limit", "not_found",
                           404)
        if model not in router.routes:
            return refused(f"model {model!r:.80} is not served here", "model_not_found", 404)
        if action == "limit":
            return await _limit(router, model, request, refused)
        if router.elastic is None:
            return refused(f"model {model} is not elastic: it never sleeps", "not_elastic", 409)
        try:
            done = await (router.elastic.sleep(model) if action == "sleep"
                          else router.elastic.wake(model))
        except NotElastic as exc:
            return refused(str(exc), "conflict", 409)
        except CannotWake as exc:
            return router.cannot_wake(exc)
        return JSONResponse(done.describe(router.elastic.clock()))


async def _limit(router: Router, model: str, request: Request,
                 refused: Callable[[str, str, int], JSONResponse]) -> Response:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > LIMIT_BODY_BYTES:
            return refused(f"the body is over {LIMIT_BODY_BYTES} bytes", "request_too_large",
                           413)
    try:
        limit_bytes = parse_limit(raw)
    except BadLimit as exc:
        return refused(str(exc), "invalid_limit", 400)
    limits = router.kv_limits
    runtimes = [r.runtime_id for r in router.routes[model].replicas]
    slab_sizes = [limits.slab_bytes(r) for r in runtimes] if limits is not None else [None]
    if limits is None or None in slab_sizes:
        return refused(f"model {model}'s KV is SGLang's own pool (kv_pool: sglang), not the "
                       "arena: it has no KV limit", "not_in_arena", 409)
    one_slab = max(size for size in slab_sizes if size is not None)
    if limit_bytes is not None and limit_bytes < one_slab:
        return refused(f"a KV limit of {limit_bytes} B is below one slab ({one_slab} B): "
                       f"{model} could hold no KV at all", "invalid_limit", 400)
    for runtime_id in runtimes:
        limits.set(runtime_id, limit_bytes)
    answer: dict[str, Any] = {"model": model, "kv_limit_bytes": limit_bytes,
                              "kv_limits": model_limits(router, model)}
    return JSONResponse(answer)


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, refusing (BodyTooLarge) as soon as it passes `limit_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


UNAUTHORIZED = error_body("missing or wrong API key (Authorization: Bearer ...)",
                          "authentication_error", "invalid_api_key")


async def authorized_body(request: Request, api_key: str | None, limit: int
                          ) -> bytes | JSONResponse:
    """The request's body, or the error: 401 without the key, 413 over `limit` bytes."""
    if not authorized(request, api_key):
        return JSONResponse(UNAUTHORIZED, 401)
    try:
        return await read_body(request, limit)
    except BodyTooLarge:
        return JSONResponse(error_body(
            f"the request body is over this router's limit of {limit} bytes",
            "invalid_request_error", "request_too_large"), 413, headers={"Connection": "close"})

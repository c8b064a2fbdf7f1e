"""The router's live state: `Router` holds the routes, replicas, queues and metrics of one node
and answers each request (`handle`: validate, queue under the local scheduler, forward, relay);
`fineslab.router.http.create_app(router)` puts it behind FastAPI.

Bodies over `INLINE_PARSE_BYTES` are parsed and tokenized on a small thread pool, so one large
prompt never stalls the event loop (and with it /health and every other stream).

The supervisor calls `router.mark_down(runtime_id, reason, back_in_s)` /
`mark_up(runtime_id, pid, base_url)` from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response

from fineslab.connections import pooled_connector
from fineslab.router.attribution import CrashAttribution, fingerprint
from fineslab.router.elastic import CannotWake, Elastic
from fineslab.router.metrics import LiveCollector, RouterMetrics
from fineslab.router.proxy import drop_response, error_body, forward, runtime_body
from fineslab.router.queues import ModelQueue, NoLiveRuntime, RequestDropped
from fineslab.router.replicas import Replica
from fineslab.router.requests import (
    BadRequest,
    ParsedRequest,
    PromptCounter,
    parse_body,
    read_request,
)
from fineslab.router.routes import KVLimits, ModelRoute, RouterSettings
from fineslab.scheduler.local import get_batch_policy
from fineslab.slabs import TableSnapshot
from fineslab.slabs.streamctl import StreamState

logger = logging.getLogger(__name__)

SlabSource = Callable[[], dict[str, TableSnapshot]]

#: Bodies up to this size are parsed on the loop (about 50 us); larger ones on `_parse_pool`.
INLINE_PARSE_BYTES = 16 * 1024
#: Tokenizing a 750 KB prompt takes about 1-2 s of one core; half the cores at most, so the
#: loop always has one (on 2 cores, 8 such prompts at once kept /health under 0.5 s p50).
PARSE_THREADS = max(1, (os.cpu_count() or 2) // 2)


class Router:
    """Routes, replicas and queues of one node; all mutation happens on the app's loop."""

    def __init__(self, routes: Sequence[ModelRoute], settings: RouterSettings,
                 slabs: SlabSource | None = None, elastic: Elastic | None = None,
                 kv_limits: KVLimits | None = None,
                 streaming: Callable[[], Mapping[str, StreamState]] | None = None) -> None:
        self.routes = {r.name: r for r in routes}
        self.elastic = elastic
        self.kv_limits = kv_limits
        #: runtime id -> its layer-streaming state (docs/streaming.md); None: no streaming
        self.streaming = streaming
        self.slabs: SlabSource = slabs or dict
        self.settings = settings
        self.metrics = RouterMetrics()
        self.metrics.register_live(LiveCollector(self, self.metrics, slabs or dict))
        self.counters = {r.name: PromptCounter(r.tokenizer_dir) for r in routes}
        self.replicas: dict[str, list[Replica]] = {}
        self.queues: dict[str, ModelQueue] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending_state: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="fineslab-parse")
        self.attribution = CrashAttribution()

    # -- lifecycle (on the loop) ----------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for name, route in self.routes.items():
            self.metrics.init_model(name)
            self.replicas[name] = [Replica(rr, self._client(rr.base_url))
                                   for rr in route.replicas]
            self.queues[name] = ModelQueue(route, self.replicas[name],
                                           get_batch_policy(self.settings.batch_policy),
                                           self.settings, self.metrics)
            self._tasks.append(asyncio.create_task(self.queues[name].run()))
        for apply, args in self._pending_state:
            apply(*args)
        self._pending_state.clear()
        if self.elastic is not None:
            self.elastic.start(self)

    def _client(self, base_url: str) -> aiohttp.ClientSession:
        # aiohttp, not httpx: about 3x less CPU per proxied request (measured with the bench).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0,
                                        sock_read=self.settings.upstream_timeout_s)
        return aiohttp.ClientSession(base_url=base_url, timeout=timeout,
                                     connector=pooled_connector())

    async def stop(self) -> None:
        if self.elastic is not None:
            await self.elastic.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replicas in self.replicas.values():
            for replica in replicas:
                await replica.client.close()
        self._parse_pool.shutdown(wait=False, cancel_futures=True)

    # -- supervision (any thread) ---------------------------------------------------------------

    def mark_down(self, runtime_id: str, reason: str | None = None,
                  back_in_s: float | None = None) -> None:
        """The runtime stopped serving; with a `reason`, it is being restarted and expected
        back in `back_in_s` (None: unknown)."""
        self._post_state(self._apply_down, runtime_id, reason, back_in_s)

    def stop_serving(self) -> None:
        """Every runtime down, for good: in-flight requests end at once in their error (a
        stop waited out uvicorn's graceful timeout for a hung one, then logged a traceback),
        new ones are refused."""
        for replicas in self.replicas.values():
            for replica in replicas:
                self._post_state(self._apply_down, replica.runtime_id, None, None)

    def mark_up(self, runtime_id: str, pid: int | None = None,
                base_url: str | None = None) -> None:
        """The runtime is serving (again); `base_url` when it came back on another port."""
        if self.loop is None and base_url is not None:
            raise ValueError("a runtime's URL can change only once the router is started")
        self._post_state(self._apply_up, runtime_id, pid, base_url)

    def _post_state(self, apply: Callable[..., None], *args: Any) -> None:
        if self.loop is None:  # not started yet: applied at start, in order
            self._pending_state.append((apply, args))
        else:
            self.loop.call_soon_threadsafe(apply, *args)

    def _replicas_of(self, runtime_id: str) -> Iterable[tuple[str, Replica]]:
        for name, replicas in self.replicas.items():
            for replica in replicas:
                if replica.runtime_id == runtime_id:
                    yield name, replica

    def _apply_down(self, runtime_id: str, reason: str | None, back_in_s: float | None) -> None:
        for name, replica in self._replicas_of(runtime_id):
            replica.mark_down(reason, back_in_s)
            logger.warning("runtime %s is down (%s); its requests get errors", runtime_id,
                           reason or "marked down")
            self.queues[name].wake()

    def _apply_up(self, runtime_id: str, pid: int | None, base_url: str | None) -> None:
        for name, replica in self._replicas_of(runtime_id):
            if base_url is not None and base_url != replica.route.base_url:
                logger.info("runtime %s moved from %s to %s", runtime_id,
                            replica.route.base_url, base_url)
                old = replica.move(base_url, self._client(base_url))
                self._tasks.append(asyncio.create_task(old.close()))
            replica.mark_up()
            replica.pid = pid if pid is not None else replica.pid
            if self.elastic is not None:
                self.elastic.runtime_restarted(runtime_id)
            self.queues[name].wake()

    # -- LiveState for the metrics collector ----------------------------------------------------

    def queue_lengths(self) -> dict[str, int]:
        return {name: len(queue) for name, queue in self.queues.items()}

    def replica_states(self) -> Iterable[tuple[str, str, bool, int]]:
        for name, replicas in self.replicas.items():
            for r in replicas:
                yield name, r.runtime_id, r.up, r.restarts

    def model_states(self) -> dict[str, str]:
        """Elastic models' states (awake, sleeping, asleep, waking)."""
        if self.elastic is None:
            return {}
        return {name: m.state.value for name, m in self.elastic.models.items()}

    def stream_states(self) -> dict[tuple[str, str], StreamState]:
        """(model, runtime id) -> the runtime's layer-streaming state (streaming models)."""
        if self.streaming is None:
            return {}
        states = self.streaming()
        return {(name, r.runtime_id): states[r.runtime_id]
                for name, route in self.routes.items() for r in route.replicas
                if r.runtime_id in states}

    def demand(self) -> dict[str, int]:
        """Per runtime: its requests in flight plus those its model's queue holds (read from
        any thread; a moment's staleness is fine for the cache reclaimer)."""
        out: dict[str, int] = {}
        waking = self.elastic.models if self.elastic is not None else {}
        for name, replicas in list(self.replicas.items()):
            queued = len(self.queues[name]) if name in self.queues else 0
            if name in waking:
                queued += waking[name].entering  # waiting for its wake: room is wanted
            for r in replicas:
                out[r.runtime_id] = r.inflight + queued
        return out

    def health(self) -> tuple[bool, dict[str, Any]]:
        """The fleet is serving while any model is; `model_status` says which are."""
        models = {name: [r.state() for r in replicas] for name, replicas in self.replicas.items()}
        serving = {name: any(r.up for r in replicas) for name, replicas in self.replicas.items()}
        all_up = all(r.up for replicas in self.replicas.values() for r in replicas)
        any_serving = any(serving.values())
        status = "ok" if all_up else ("degraded" if any_serving else "unavailable")
        states = self.model_states()
        return any_serving, {"status": status, "models": models,
                             "model_status": {n: (states.get(n, "serving") if up
                                                  else self._down_state(n))
                                              for n, up in serving.items()}}

    def _down_state(self, name: str) -> str:
        """A model none of whose runtimes is up: `restarting` while the supervisor brings one
        back (its elastic state said `awake` meanwhile), else `down`."""
        return "restarting" if any(r.down_reason for r in self.replicas[name]) else "down"

    def live_state(self, name: str) -> str:
        """What a model is doing now, for /health/{model} and `ctl list`: its elastic state
        (or `serving`) while a runtime of it is up, else `restarting` or `down`."""
        if any(r.up for r in self.replicas[name]):
            return self.model_states().get(name, "serving")
        return self._down_state(name)

    def model_health(self, name: str) -> tuple[int, dict[str, Any]]:
        replicas = self.replicas.get(name)
        if replicas is None:
            return 404, error_body(f"model {name!r} is not served here; see /v1/models",
                                   "invalid_request_error", "model_not_found")
        live = sum(r.up for r in replicas)
        status = "ok" if live == len(replicas) else ("degraded" if live else "down")
        body = {"model": name, "status": status, "replicas": [r.state() for r in replicas]}
        if name in self.model_states() or not live:
            body["state"] = self.live_state(name)  # an asleep model is healthy: a request wakes it
        return (200 if live else 503), body

    # -- one request ----------------------------------------------------------------------------

    async def handle(self, raw: bytes, path: str, chat: bool) -> Response:
        try:
            if len(raw) <= INLINE_PARSE_BYTES:
                route, parsed, key = self._read(raw, path, chat)
            else:
                loop = asyncio.get_running_loop()
                route, parsed, key = await loop.run_in_executor(self._parse_pool, self._read,
                                                                raw, path, chat)
        except BadRequest as exc:
            return bad_request(exc)
        except UnknownModel as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error",
                                           "model_not_found", "model"), 404)
        if self.attribution.is_poison(key):
            return self.attribution.refuse(route.name)
        try:
            return await self._serve(route, parsed, path, key)
        except asyncio.CancelledError:  # its client left (disconnect.py)
            self.metrics.abandoned(route.name)
            raise

    async def _serve(self, route: ModelRoute, parsed: ParsedRequest, path: str,
                     key: str) -> Response:
        queue = self.queues[route.name]
        if self.elastic is None:
            return await self.attribution.serve(route.name, key,
                                                lambda: self._attempt(queue, parsed, path),
                                                queue.can_take_soon)
        try:
            async with self.elastic.use(route.name) as queued:
                return await self.attribution.serve(
                    route.name, key, lambda: self._attempt(queue, parsed, path, queued),
                    queue.can_take_soon)
        except CannotWake as exc:
            return self.cannot_wake(exc)

    def cannot_wake(self, exc: CannotWake) -> JSONResponse:
        retry_s = self.elastic.retry_after_s if self.elastic is not None else 1
        return JSONResponse(error_body(str(exc), "runtime_unavailable", "model_asleep"), 503,
                            headers={"Retry-After": str(retry_s)})

    async def _attempt(self, queue: ModelQueue, parsed: ParsedRequest, path: str,
                       queued: Callable[[], None] = lambda: None) -> tuple[Response, bool]:
        """Queue the request (`queued()` as the queue takes it), then forward it: (the
        response, whether a runtime answered); raises RuntimeLost (see attribution.py)."""
        try:
            queued()  # acquire puts it in the queue before it first waits
            lease = await queue.acquire(parsed.prompt_tokens)
        except NoLiveRuntime as exc:
            retry_s = exc.retry_after_s or self.settings.retry_after_s
            return JSONResponse(error_body(str(exc), "runtime_unavailable", "runtime_down"), 503,
                                headers={"Retry-After": str(retry_s)}), False
        except RequestDropped as exc:
            return drop_response(self.settings, str(exc)), False
        body = runtime_body(parsed.body, queue.route, lease)
        return await forward(queue, lease, path, body, parsed.stream), True

    def _read(self, raw: bytes, path: str, chat: bool) -> tuple[ModelRoute, ParsedRequest, str]:
        """Parse, validate and fingerprint one body (on the loop or the parse pool: touches no
        live state)."""
        body = parse_body(raw)
        route = self.routes.get(body["model"])
        if route is None:
            raise UnknownModel(f"model {body['model']!r:.80} is not served here; see /v1/models")
        return route, read_request(body, self.counters[route.name], chat, route.context_tokens,
                                   route.vocab_size, route.budget()), fingerprint(path, raw)


class UnknownModel(Exception):
    pass


def bad_request(exc: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "invalid_request_error", exc.code, exc.param), 400)

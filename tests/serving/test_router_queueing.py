"""The router against a real local HTTP backend (the echo backend): endpoints, errors, the local
scheduler's drops, best effort, API key, supervision, metrics. Runs in about 10 s."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterable, Iterator

import httpx
import pytest

from fineslab.router import ModelRoute, ReplicaRoute, Router, RouterServer, RouterSettings
from fineslab.router.testing import start_echo_backend
from fineslab.runtime import free_port


class LinearPredictor:
    """TTFT = seconds_per_token x batched prompt tokens (a stand-in for a profile)."""

    def __init__(self, seconds_per_token: float) -> None:
        self.seconds_per_token = seconds_per_token

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.seconds_per_token * sum(prompt_tokens)


@pytest.fixture(scope="module")
def backend_url() -> Iterator[str]:
    port = free_port()
    proc = start_echo_backend(port, delay_s=0.3, token_gap_s=0.01)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def _route(name: str, url: str, slo_s: float = 5.0, s_per_token: float = 0.001,
           max_running: int = 4) -> ModelRoute:
    return ModelRoute(name, (ReplicaRoute(f"{name}-r0", url),), slo_s,
                      LinearPredictor(s_per_token), tokenizer_dir=None, context_tokens=256,
                      max_running_requests=max_running)


def _serve(routes: list[ModelRoute], **settings: object) -> RouterServer:
    server = RouterServer(Router(routes, RouterSettings(**settings)))  # type: ignore[arg-type]
    server.start()
    return server


@pytest.fixture(scope="module")
def router(backend_url: str) -> Iterator[RouterServer]:
    server = _serve([_route("fast", backend_url),
                     # a prompt of 100 chars (25 tokens) takes 2.5 s alone: over its 1 s SLO
                     _route("strict", backend_url, slo_s=1.0, s_per_token=0.1)])
    yield server
    server.stop()


def test_models_and_health_list_every_model(router: RouterServer) -> None:
    models = httpx.get(router.base_url + "/v1/models", timeout=30).json()
    assert sorted(m["id"] for m in models["data"]) == ["fast", "strict"]
    health = httpx.get(router.base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_and_chat_are_proxied(router: RouterServer) -> None:
    body = {"model": "fast", "prompt": "hi", "max_tokens": 3}
    reply = httpx.post(router.base_url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "tok0 tok1 tok2"
    chat = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(router.base_url + "/v1/chat/completions", json=chat, timeout=30)
    assert reply.json()["choices"][0]["message"]["content"] == "tok0 tok1"


def test_streaming_passes_every_event_through(router: RouterServer) -> None:
    body = {"model": "fast", "prompt": "hi", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", router.base_url + "/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[5:])["choices"][0]["text"] for line in lines[:-1]]
    assert texts == [f" tok{i}" for i in range(5)]


@pytest.mark.parametrize(("payload", "status", "code"), [
    (b"{not json", 400, "invalid_request"),
    (b"[1, 2]", 400, "invalid_request"),
    (json.dumps({"prompt": "no model"}).encode(), 400, "invalid_request"),
    (json.dumps({"model": "fast"}).encode(), 400, "invalid_request"),
    (json.dumps({"model": "fast", "prompt": "x", "max_tokens": -1}).encode(), 400,
     "invalid_request"),
    (json.dumps({"model": "fast", "prompt": "x" * 2000}).encode(), 400,
     "context_length_exceeded"),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model_not_found"),
])
def test_bad_requests_get_their_status_and_a_json_error(router: RouterServer, payload: bytes,
                                                        status: int, code: str) -> None:
    reply = httpx.post(router.base_url + "/v1/completions", content=payload,
                       headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["code"] == code
    assert httpx.get(router.base_url + "/health", timeout=30).status_code == 200, "still healthy"


def test_a_request_that_cannot_meet_its_slo_gets_429_with_retry_after(
        router: RouterServer) -> None:
    body = {"model": "strict", "prompt": "x" * 100, "max_tokens": 1}
    reply = httpx.post(router.base_url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 429, reply.text
    assert reply.headers["retry-after"] == "1"
    assert "cannot meet its deadline" in reply.json()["error"]["message"]
    ok = httpx.post(router.base_url + "/v1/completions",
                    json={"model": "strict", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, "a short prompt fits the SLO and is served"


def test_queue_releases_at_most_max_running_and_drops_what_waits_too_long(
        router: RouterServer) -> None:
    """16 requests on max_running 4 with a 0.3 s backend and a 1 s SLO: the first waves are
    served; what waits past its deadline is dropped, not served late."""
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            body = {"model": "strict", "prompt": "xxxx", "max_tokens": 1}
            replies = await asyncio.gather(*[client.post("/v1/completions", json=body)
                                             for _ in range(16)])
        return [r.status_code for r in replies]

    codes = asyncio.run(burst())
    assert codes.count(200) >= 4, codes
    assert codes.count(429) >= 1, f"some requests must miss a 1 s SLO behind 0.3 s waves: {codes}"
    assert set(codes) <= {200, 429}, codes
    metrics = httpx.get(router.base_url + "/metrics", timeout=30).text
    assert 'fineslab_requests_dropped_total{model="strict",outcome="rejected"}' in metrics
    assert 'fineslab_queue_length{model="strict"} 0.0' in metrics, "the queue drains"


def test_metrics_expose_ttft_tpot_and_slo_attainment(router: RouterServer) -> None:
    body = {"model": "fast", "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", router.base_url + "/v1/completions", json=body, timeout=30) as r:
        r.read()
    text = httpx.get(router.base_url + "/metrics", timeout=30).text
    for series in ('fineslab_ttft_seconds_count{model="fast"}',
                   'fineslab_tpot_seconds_count{model="fast"}',
                   'fineslab_ttft_slo_attainment{model="fast"} 1.0',
                   'fineslab_requests_admitted_total{model="fast"}',
                   'fineslab_runtime_up{model="fast",runtime="fast-r0"} 1.0'):
        assert series in text, series


def test_best_effort_serves_what_the_scheduler_would_drop(backend_url: str) -> None:
    server = _serve([_route("strict", backend_url, slo_s=1.0, s_per_token=0.1)],
                    on_drop="best_effort", drop_status=503)
    try:
        body = {"model": "strict", "prompt": "x" * 100, "max_tokens": 1}
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
        assert 'fineslab_requests_dropped_total{model="strict",outcome="best_effort"} 1.0' \
            in metrics
    finally:
        server.stop()


def test_api_key_is_required_when_configured(backend_url: str) -> None:
    server = _serve([_route("fast", backend_url)], api_key="s3cret")
    try:
        body = {"model": "fast", "prompt": "hi", "max_tokens": 1}
        url = server.base_url + "/v1/completions"
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401
        ok = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200
        health = httpx.get(server.base_url + "/health", timeout=30)
        assert health.status_code == 200, "health stays open"
        for method, path in (("GET", "/admin/models"), ("GET", "/admin/arenas"),
                             ("POST", "/admin/models/fast/sleep"),
                             ("POST", "/admin/models/fast/limit")):
            refused = httpx.request(method, server.base_url + path, timeout=30)
            assert refused.status_code == 401, f"{method} {path} is behind the key"
        allowed = httpx.get(server.base_url + "/admin/models", timeout=30,
                            headers={"Authorization": "Bearer s3cret"})
        assert allowed.status_code == 200 and allowed.json()["models"] == [
            {"model": "fast", "state": "serving", "elastic": False, "kv_limits": {}}]
        not_elastic = httpx.post(server.base_url + "/admin/models/fast/sleep", timeout=30,
                                 headers={"Authorization": "Bearer s3cret"})
        assert not_elastic.status_code == 409, not_elastic.text
        no_arena = httpx.post(server.base_url + "/admin/models/fast/limit", timeout=30,
                              json={"kv_bytes": 1 << 30},
                              headers={"Authorization": "Bearer s3cret"})
        assert no_arena.status_code == 409 and "not the arena" in no_arena.text, no_arena.text
    finally:
        server.stop()


def test_a_runtime_marked_down_fails_its_inflight_requests_at_once() -> None:
    # A backend slow enough (5 s a request) that "at once" is unambiguous on a loaded machine.
    port = free_port()
    slow = start_echo_backend(port, delay_s=5.0, token_gap_s=0.01)
    server = _serve([_route("fast", f"http://127.0.0.1:{port}")])
    try:
        replica = server.router.replicas["fast"][0]

        async def scenario() -> tuple[int, str, int, float]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                body = {"model": "fast", "prompt": "hi", "max_tokens": 2}
                pending = asyncio.ensure_future(client.post("/v1/completions", json=body))
                for _ in range(500):  # until the router has handed it to the runtime
                    if replica.inflight == 1:
                        break
                    await asyncio.sleep(0.01)
                assert replica.inflight == 1, "the request must be in flight at the runtime"
                marked = asyncio.get_running_loop().time()
                server.router.mark_down("fast-r0", reason="exited with -9")
                reply = await pending
                waited = asyncio.get_running_loop().time() - marked
                health = await client.get("/health")
                return reply.status_code, reply.json()["error"]["code"], health.status_code, waited

        status, code, health, waited = asyncio.run(scenario())
        assert waited < 2.5, f"the in-flight request must fail at once, not after {waited:.1f} s"
        assert (status, code) == (502, "runtime_down")
        assert health == 503, "with its only model down, the router serves nothing"
        server.router.mark_up("fast-r0", pid=123)
        reply = httpx.post(server.base_url + "/v1/completions",
                           json={"model": "fast", "prompt": "hi", "max_tokens": 1}, timeout=30)
        assert reply.status_code == 200, "served again once the runtime is back"
        text = httpx.get(server.base_url + "/metrics", timeout=30).text
        assert 'fineslab_runtime_restarts{model="fast",runtime="fast-r0"} 1.0' in text
    finally:
        server.stop()
        slow.terminate()
        slow.wait(10)


@pytest.mark.parametrize("on_drop", ["reject", "best_effort"])
def test_a_request_for_a_model_with_no_runtime_up_gets_503_by_its_deadline(
        backend_url: str, on_drop: str) -> None:
    server = _serve([_route("strict", backend_url, slo_s=1.0, s_per_token=0.001)],
                    on_drop=on_drop)
    try:
        server.router.mark_down("strict-r0")
        body = {"model": "strict", "prompt": "hi", "max_tokens": 1}
        url = server.base_url + "/v1/completions"
        reply = httpx.post(url, json=body, timeout=30)
        waited = reply.elapsed.total_seconds()
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "runtime_down"
        assert "has no runtime up" in reply.json()["error"]["message"]
        assert "retry-after" in reply.headers
        assert 0.9 <= waited < 5.0, f"it waits for a restart until its 1 s deadline, not {waited}"
        server.router.mark_up("strict-r0", pid=123)
        assert httpx.post(url, json=body, timeout=30).status_code == 200, "served once back"
    finally:
        server.stop()


def test_a_model_restarting_for_longer_than_its_slo_is_refused_at_once_with_retry_after(
        backend_url: str) -> None:
    # Issue #15, defect 4: after a give-up every request waited 5 s for a 503, for ever.
    server = _serve([_route("strict", backend_url, slo_s=1.0, s_per_token=0.001)])
    try:
        server.router.mark_down("strict-r0", reason="exited with -9", back_in_s=30)
        reply = httpx.post(server.base_url + "/v1/completions", timeout=30,
                           json={"model": "strict", "prompt": "hi", "max_tokens": 1})
        assert reply.status_code == 503, reply.text
        assert reply.elapsed.total_seconds() < 0.5, "no wait for a restart that comes too late"
        assert 28 <= int(reply.headers["retry-after"]) <= 30, reply.headers
        assert "expected back in about" in reply.json()["error"]["message"]
        health = httpx.get(server.base_url + "/health", timeout=30).json()
        replica = health["models"]["strict"][0]
        assert (replica["state"], replica["restarts"]) == ("restarting", 1), replica
        # Issue #35: /health and `ctl list` said an elastic model was "awake" meanwhile.
        assert health["model_status"]["strict"] == "restarting", health
        one = httpx.get(server.base_url + "/health/strict", timeout=30)
        assert one.status_code == 503 and one.json()["state"] == "restarting", one.text
        listed = httpx.get(server.base_url + "/admin/models", timeout=30).json()["models"]
        assert [m["state"] for m in listed] == ["restarting"], listed
    finally:
        server.stop()


def test_a_runtime_back_on_another_port_is_served_there(backend_url: str) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server = _serve([_route("fast", dead_url)])
    try:
        url = server.base_url + "/v1/completions"
        body = {"model": "fast", "prompt": "hi", "max_tokens": 1}
        assert httpx.post(url, json=body, timeout=30).status_code == 502, "unreachable at first"
        server.router.mark_down("fast-r0")
        server.router.mark_up("fast-r0", pid=123, base_url=backend_url)
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        health = httpx.get(server.base_url + "/health", timeout=30).json()
        assert backend_url in json.dumps(health), health
    finally:
        server.stop()


def test_a_stop_ends_hung_requests_in_their_error_at_once() -> None:
    # Issue #35: Ctrl-C waited out uvicorn's 5 s graceful timeout for a hung request, then
    # logged a traceback; the runtimes are stopped right after the router anyway.
    port = free_port()
    hung = start_echo_backend(port, delay_s=60.0)
    try:
        server = _serve([_route("slow", f"http://127.0.0.1:{port}")])
        answers: dict[bool, httpx.Response | BaseException] = {}

        def ask(stream: bool) -> None:
            try:
                answers[stream] = httpx.post(server.base_url + "/v1/completions", timeout=60,
                                             json={"model": "slow", "prompt": "hi",
                                                   "max_tokens": 2, "stream": stream})
            except httpx.HTTPError as exc:
                answers[stream] = exc

        clients = [threading.Thread(target=ask, args=(s,)) for s in (False, True)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 10
        while sum(r["inflight"] for r in server.router.health()[1]["models"]["slow"]) < 2:
            assert time.monotonic() < deadline, "both requests reach the backend"
            time.sleep(0.05)
        began = time.monotonic()
        server.stop()
        stopped_s = time.monotonic() - began
        for client in clients:
            client.join(10)
        assert stopped_s < 2.0, f"the stop took {stopped_s:.1f} s"
        for stream, answer in answers.items():
            assert isinstance(answer, httpx.Response) and answer.status_code == 502, \
                (stream, answer)
            assert answer.json()["error"]["code"] == "runtime_down", answer.text
    finally:
        hung.kill()  # it would wait out its own hung answers
        hung.wait(10)

"""The front router against two fake node routers, over real HTTP (no Ray, no SGLang).

    client (openai / httpx) --> FrontServer --> fake node "a" (aiohttp, in process)
                                           \\-> fake node "b"
                                           \\-> node "dead" (a bound socket that never
                                                listens: every connect is refused)

A fake node answers /v1/completions with its own name in the text, streams `STREAM_EVENTS`
SSE events then `[DONE]`, and takes orders from a `fake` field of the body (`slow`: 0.2 s
between events or 20 s before a whole answer, `hang`: nothing for 20 s, `error400`, `busy`:
503 + Retry-After). It records each request's raw body and Authorization header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from fineslab.cluster import front as front_module
from fineslab.cluster.front import FrontRouter, FrontSettings
from fineslab.cluster.front_app import FrontServer

FRONT_KEY = "sk-front"
NODE_KEY = "sk-node"
STREAM_EVENTS = 5
SLOW_GAP_S = 0.2
NODE_400 = (b'{"error": {"message": "max_tokens must be positive", '
            b'"type": "invalid_request_error", "code": "invalid_value", "param": "max_tokens"}}')
NODE_METRICS = ('# HELP fake_requests_total Requests at the fake node.\n'
                '# TYPE fake_requests_total counter\n'
                'fake_requests_total{model="m1"} 3.0\n'
                '# HELP fake_up One while up.\n# TYPE fake_up gauge\nfake_up 1.0\n')
LEAKS = ("Traceback", 'File "', "/site-packages/", ".venv", "/work/", "fineslab/")


@dataclass
class FakeNode:
    name: str
    url: str = ""
    seen: list[tuple[bytes, str]] = field(default_factory=list)  # (raw body, Authorization)
    cancelled: int = 0  # requests whose connection the front closed while they waited

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append((raw, request.headers.get("Authorization", "")))
        body = json.loads(raw)
        order = body.get("fake")
        if order == "error400":
            return web.Response(body=NODE_400, status=400, content_type="application/json")
        if order == "busy":
            return web.json_response({"error": {"message": "busy", "type": "slo_drop",
                                                "code": 503, "param": None}}, status=503,
                                     headers={"Retry-After": "9"})
        if order == "hang" or (order == "slow" and not body.get("stream")):
            try:
                await asyncio.sleep(20)
            except asyncio.CancelledError:  # aiohttp's handler cancellation: the front left
                self.cancelled += 1
                raise
        if not body.get("stream"):
            return web.json_response(_completion(body["model"], f"from {self.name}"))
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        try:
            for i in range(STREAM_EVENTS if order != "slow" else 100):
                if order == "slow" and i:
                    await asyncio.sleep(SLOW_GAP_S)
                event = _completion(body["model"], f" tok{i}@{self.name}")
                await reply.write(f"data: {json.dumps(event)}\n\n".encode())
            await reply.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the front closed the stream (a lost node, a client gone)
        return reply

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=NODE_METRICS, content_type="text/plain")


def _completion(model: str, text: str) -> dict[str, Any]:
    return {"id": "fake", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}]}


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, FakeNode]]:
    """Nodes a and b on one background loop, each on a free port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-nodes", daemon=True)
    thread.start()
    fakes = {name: FakeNode(name) for name in ("a", "b")}
    runners: list[web.AppRunner] = []

    async def serve(fake: FakeNode) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", fake.completions)
        app.router.add_get("/metrics", fake.metrics)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        runners.append(runner)

    for fake in fakes.values():
        asyncio.run_coroutine_threadsafe(serve(fake), loop).result(10)
    yield fakes
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def dead_url() -> Iterator[str]:
    """A port that refuses every connection: bound, never listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _start(nodes: dict[str, FakeNode], dead_url: str, **settings: Any) -> FrontServer:
    front = FrontRouter(FrontSettings(**{"api_key": FRONT_KEY, "node_api_key": NODE_KEY,
                                         "max_body_bytes": 64 * 1024, **settings}))
    a, b = ("a", nodes["a"].url), ("b", nodes["b"].url)
    front.set_routes({"m-a": [a], "m-b": [b], "m-both": [a, b], "m-dead": [("dead", dead_url)]})
    server = FrontServer(front)
    server.start()
    return server


@pytest.fixture
def server(nodes: dict[str, FakeNode], dead_url: str) -> Iterator[FrontServer]:
    server = _start(nodes, dead_url)
    yield server
    server.front.check_integrity()
    server.stop()


def _client(server: FrontServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=FRONT_KEY, max_retries=0,
                         timeout=10)


def _post(server: FrontServer, body: object, key: str | None = FRONT_KEY,
          timeout_s: float = 10) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + "/v1/completions", json=body, headers=headers,
                      timeout=timeout_s)


def _assert_error(reply: httpx.Response, status: int, code: str) -> str:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}, f"one error shape: {error}"
    assert error["code"] == code, error
    for leak in LEAKS:
        assert leak not in reply.text, f"internal detail {leak!r} in {reply.text!r}"
    return str(error["message"])


def test_each_model_is_routed_to_its_node(server: FrontServer) -> None:
    client = _client(server)
    for model, node in (("m-a", "a"), ("m-b", "b")):
        answer = client.completions.create(model=model, prompt="hi", max_tokens=3)
        assert answer.choices[0].text == f"from {node}", f"{model} must be served by node {node}"


def test_raw_body_and_node_key_reach_the_node(server: FrontServer,
                                              nodes: dict[str, FakeNode]) -> None:
    raw = b'{ "prompt":"hi",\n  "model" : "m-b", "max_tokens": 2.0 }'
    reply = httpx.post(server.base_url + "/v1/completions", content=raw, timeout=10,
                       headers={"Authorization": f"Bearer {FRONT_KEY}",
                                "Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert nodes["b"].seen[-1] == (raw, f"Bearer {NODE_KEY}"), \
        "the node gets the client's bytes unchanged and the node key, not the front key"


def test_stream_passes_through_the_openai_client(server: FrontServer) -> None:
    stream = _client(server).completions.create(model="m-a", prompt="hi", max_tokens=3,
                                                stream=True)
    texts = [chunk.choices[0].text for chunk in stream]
    assert texts == [f" tok{i}@a" for i in range(STREAM_EVENTS)], texts


def test_least_loaded_node_takes_the_request(server: FrontServer) -> None:
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=10,
                      json={"model": "m-both", "stream": True, "fake": "slow"},
                      headers={"Authorization": f"Bearer {FRONT_KEY}"}) as busy:
        first = next(busy.iter_lines())
        busy_node = "a" if "@a" in first else "b"
        other = _post(server, {"model": "m-both", "prompt": "hi"}).json()
        assert other["choices"][0]["text"] == f"from {'b' if busy_node == 'a' else 'a'}", \
            "the node with a request in flight is passed over"


@pytest.mark.parametrize(("case", "status", "code"), [
    ("no key", 401, "invalid_api_key"),
    ("wrong key", 401, "invalid_api_key"),
    ("body over the limit", 413, "request_too_large"),
    ("chunked body over the limit", 413, "request_too_large"),
    ("not JSON", 400, "invalid_request"),
    ("JSON list", 400, "invalid_request"),
    ("no model", 400, "invalid_request"),
    ("unknown model", 404, "model_not_found"),
    ("GET on a POST path", 405, "method_not_allowed"),
    ("unknown path", 404, "not_found"),
])
def test_front_errors_have_the_one_shape(server: FrontServer, case: str, status: int,
                                         code: str) -> None:
    url, auth = server.base_url + "/v1/completions", {"Authorization": f"Bearer {FRONT_KEY}"}
    big = json.dumps({"model": "m-a", "prompt": "x" * 100_000}).encode()

    def chunks() -> Iterator[bytes]:
        yield from (big[i:i + 8192] for i in range(0, len(big), 8192))

    replies = {
        "no key": lambda: _post(server, {"model": "m-a"}, key=None),
        "wrong key": lambda: _post(server, {"model": "m-a"}, key="sk-wrong"),
        "body over the limit": lambda: httpx.post(url, content=big, headers=auth),
        "chunked body over the limit": lambda: httpx.post(url, content=chunks(), headers=auth),
        "not JSON": lambda: httpx.post(url, content=b"{model", headers=auth),
        "JSON list": lambda: _post(server, ["m-a"]),
        "no model": lambda: _post(server, {"prompt": "hi"}),
        "unknown model": lambda: _post(server, {"model": "nope"}),
        "GET on a POST path": lambda: httpx.get(url, headers=auth),
        "unknown path": lambda: httpx.post(server.base_url + "/v2/nothing", headers=auth),
    }
    reply = replies[case]()
    message = _assert_error(reply, status, code)
    if case == "unknown model":
        assert "m-a" in message and "m-both" in message, f"served models listed: {message}"
    if case == "chunked body over the limit":
        assert "content-length" not in {k.lower() for k in reply.request.headers}, \
            "this case sends no Content-Length: the front must count while reading"


def test_node_answers_pass_through_unchanged(server: FrontServer) -> None:
    rejected = _post(server, {"model": "m-a", "fake": "error400"})
    assert (rejected.status_code, rejected.content) == (400, NODE_400), \
        "the node's 400 reaches the client byte for byte"
    assert rejected.headers["content-type"].startswith("application/json")
    busy = _post(server, {"model": "m-b", "fake": "busy"})
    assert (busy.status_code, busy.headers.get("retry-after")) == (503, "9"), \
        "a node's 503 keeps its Retry-After"


def test_moving_model_answers_503_until_it_has_a_node(server: FrontServer,
                                                      nodes: dict[str, FakeNode]) -> None:
    server.front.mark_moving(["m-a"], retry_after_s=7)
    server.front.check_integrity()
    reply = _post(server, {"model": "m-a"})
    message = _assert_error(reply, 503, "model_moving")
    assert reply.headers["retry-after"] == "7" and "moved" in message, (reply.headers, message)
    server.front.set_routes({"m-a": [("b", nodes["b"].url)]})
    assert _post(server, {"model": "m-a"}).json()["choices"][0]["text"] == "from b"


def test_lost_node_ends_the_stream_with_an_error_promptly(server: FrontServer,
                                                          nodes: dict[str, FakeNode]) -> None:
    stream = _client(server).completions.create(model="m-a", prompt="hi", stream=True,
                                                extra_body={"fake": "slow"})
    received = [next(iter(stream)).choices[0].text]
    lost_at = time.monotonic()
    server.front.mark_node_lost("a", "raylet died")
    server.front.check_integrity()
    with pytest.raises(openai.APIError) as caught:
        received.extend(chunk.choices[0].text for chunk in stream)
    assert time.monotonic() - lost_at < 3.0, "the stream must end at once, not time out"
    assert "node a was lost" in caught.value.message, caught.value.message
    assert len(received) < 10, f"the stream went on after the loss: {received}"

    reply = _post(server, {"model": "m-a"})
    message = _assert_error(reply, 503, "model_moving")
    assert "re-placed after node a was lost (raylet died)" in message, message
    assert reply.headers["retry-after"] == "1"
    server.front.set_routes({"m-a": [("b", nodes["b"].url)], "m-b": [("b", nodes["b"].url)]})
    answer = _client(server).completions.create(model="m-a", prompt="hi", max_tokens=3)
    assert answer.choices[0].text == "from b", "moved to node b, the model answers again"


def test_lost_node_ends_a_whole_request_with_502_promptly(server: FrontServer) -> None:
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, server, {"model": "m-b", "fake": "slow"})
        deadline = time.monotonic() + 5
        while server.front.state()["nodes"]["b"]["inflight"] == 0:
            assert time.monotonic() < deadline, "the request never reached the front"
            time.sleep(0.01)
        lost_at = time.monotonic()
        server.front.mark_node_lost("b", "node killed")
        server.front.check_integrity()
        reply = pending.result(10)
    assert time.monotonic() - lost_at < 3.0, "the request must end at once"
    message = _assert_error(reply, 502, "node_lost")
    assert "node b was lost" in message and "node killed" in message, message
    assert server.front.state()["nodes"]["b"] == {
        "url": server.front.state()["nodes"]["b"]["url"], "state": "lost",
        "reason": "node killed", "inflight": 0, "served": 1}


def test_node_with_a_new_url_is_a_new_upstream(server: FrontServer,
                                               nodes: dict[str, FakeNode]) -> None:
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=10,
                      json={"model": "m-a", "stream": True, "fake": "slow"},
                      headers={"Authorization": f"Bearer {FRONT_KEY}"}) as old:
        lines = old.iter_lines()
        assert "@a" in next(lines)
        server.front.set_routes({"m-a": [("a", nodes["b"].url)]})  # node a's router moved
        server.front.check_integrity()
        moved = _post(server, {"model": "m-a"}).json()["choices"][0]["text"]
        assert moved == "from b", "new requests go to the node's new URL"
        assert "@a" in next(line for line in lines if line), "the old stream goes on"
        server.front.mark_node_lost("a", "gone")
        rest = "\n".join(lines)
    assert "node a was lost" in rest, f"the loss ends the old URL's stream too: {rest[-300:]}"


def test_refusing_node_is_502_node_unreachable(server: FrontServer) -> None:
    message = _assert_error(_post(server, {"model": "m-dead"}), 502, "node_unreachable")
    assert "node dead could not be reached" in message, message


def test_silent_node_is_504_node_timeout(nodes: dict[str, FakeNode], dead_url: str) -> None:
    server = _start(nodes, dead_url, upstream_timeout_s=0.3)
    try:
        reply = _post(server, {"model": "m-a", "fake": "hang"})
    finally:
        server.stop()
    assert "sent nothing for 0.3 s" in _assert_error(reply, 504, "node_timeout")


def test_defect_is_500_in_the_error_shape(server: FrontServer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(raw: bytes) -> dict[str, Any]:
        raise RuntimeError("defect at /work/main/fineslab/secret.py")

    monkeypatch.setattr(front_module, "parse_body", broken)
    _assert_error(_post(server, {"model": "m-a"}), 500, "internal_error")
    monkeypatch.undo()
    assert _post(server, {"model": "m-a"}).status_code == 200, "the front serves on"


def test_models_lists_the_union_moving_ones_included(server: FrontServer) -> None:
    server.front.mark_moving(["m-new"])
    models = {m.id: m for m in _client(server).models.list()}
    assert set(models) == {"m-a", "m-b", "m-both", "m-dead", "m-new"}, set(models)
    assert models["m-both"].model_extra == {"nodes": ["a", "b"]}
    assert models["m-new"].owned_by == "fineslab" and models["m-new"].model_extra == {"nodes": []}


def test_health_is_200_while_every_model_has_a_node(server: FrontServer,
                                                    nodes: dict[str, FakeNode]) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/health/m-a").json()["nodes"] == ["a"]
    server.front.mark_node_lost("a", "gone")
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 503 and health.json()["without_node"] == ["m-a"], health.text
    assert httpx.get(server.base_url + "/health/m-a").status_code == 503
    assert httpx.get(server.base_url + "/health/m-b").status_code == 200
    _assert_error(httpx.get(server.base_url + "/health/nope"), 404, "model_not_found")


def test_metrics_label_the_front_and_each_node_by_node(server: FrontServer) -> None:
    _client(server).completions.create(model="m-a", prompt="hi", max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    for line in ('fineslab_front_requests_total{model="m-a",node="a",status="200"} 1.0',
                 'fineslab_front_request_seconds_count{model="m-a",node="a"} 1.0',
                 'fineslab_front_node_up{node="a"} 1.0',
                 'fineslab_front_inflight{node="b"} 0.0',
                 'fineslab_front_scrape_errors_total{node="dead"} 1.0',
                 'fake_requests_total{model="m1",node="a"} 3.0',
                 'fake_requests_total{model="m1",node="b"} 3.0',
                 'fake_up{node="a"} 1.0', 'fake_up{node="b"} 1.0'):
        assert line in text.splitlines(), f"{line!r} missing from /metrics:\n{text}"
    assert text.count("# TYPE fake_up gauge") == 1, "one TYPE line per metric name"
    lines = text.splitlines()
    up_lines = [i for i, line in enumerate(lines) if line.startswith("fake_up")]
    assert up_lines == list(range(up_lines[0], up_lines[0] + 2)), "a family's samples together"


def test_admin_nodes_needs_the_key(server: FrontServer) -> None:
    _assert_error(httpx.get(server.base_url + "/admin/nodes"), 401, "invalid_api_key")
    state = httpx.get(server.base_url + "/admin/nodes",
                      headers={"Authorization": f"Bearer {FRONT_KEY}"}).json()
    assert set(state["nodes"]) == {"a", "b", "dead"} and state["nodes"]["a"]["state"] == "up"
    assert state["models"]["m-both"] == {"nodes": ["a", "b"], "moving": False}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_leaves_closes_its_node_request_and_frees_the_link(
        server: FrontServer, nodes: dict[str, FakeNode], stream: bool) -> None:
    # Issue #35, finding 2: the node router aborts a request in SGLang when its connection
    # closes; the front must close it when its own client leaves.
    cancelled = nodes["a"].cancelled
    with contextlib.suppress(httpx.TimeoutException):
        _post(server, {"model": "m-a", "fake": "hang", "stream": stream}, timeout_s=1.0)
    deadline = time.monotonic() + 3
    while nodes["a"].cancelled == cancelled or server.front.state()["nodes"]["a"]["inflight"]:
        assert time.monotonic() < deadline, (nodes["a"].cancelled,
                                             server.front.state()["nodes"]["a"])
        time.sleep(0.05)

"""The router in front of one real SGLang runtime (llama-tiny on CPU, SGLang's own KV pool):
the `openai` client, streaming and not, completions and chat; a real-tokenizer length check;
clients that leave. (`python -m fineslab.bench.bench_serving` as the docs give it runs against
the demo fleet: test_demo_fleet.py.) One runtime for the module: about 40 s on an idle 2-core
machine."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fineslab.scheduler.local import TtftPredictor

from fineslab.router import ModelRoute, ReplicaRoute, Router, RouterServer, RouterSettings
from fineslab.runtime import ServerSpec, free_port, start_server

pytestmark = pytest.mark.slow


class FlatPredictor:
    def ttft_s(self, prompt_tokens: object) -> float:
        return 0.05


@pytest.fixture(scope="module")
def router(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = model_cache / "llama-tiny"
    spec = ServerSpec(str(model_dir), free_port(), extra_args=(
        "--served-model-name", "tiny", "--max-total-tokens", "4096", "--context-length", "512",
        "--enable-metrics"))
    log = tmp_path_factory.mktemp("router-sglang") / "runtime.log"
    predictor: TtftPredictor = FlatPredictor()
    with start_server(spec, log, timeout_s=600) as runtime:
        route = ModelRoute("tiny", (ReplicaRoute("tiny-r0", runtime.spec.base_url),), 30.0,
                           predictor, tokenizer_dir=str(model_dir), context_tokens=512)
        # the same runtime behind a route of one slot: a second request waits in the router
        one = ModelRoute("tiny-one", (ReplicaRoute("tiny-one-r0", runtime.spec.base_url),),
                         30.0, predictor, tokenizer_dir=str(model_dir), context_tokens=512,
                         max_running_requests=1)
        server = RouterServer(Router([route, one], RouterSettings()))
        server.start()
        RUNTIME_URL[server.base_url] = runtime.spec.base_url
        try:
            yield server.base_url
        finally:
            server.stop()


#: router URL -> its runtime's URL (the disconnect tests pause the runtime).
RUNTIME_URL: dict[str, str] = {}


def test_openai_client_completion_non_streaming(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    reply = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0)
    assert reply.choices[0].text, "the runtime generated text through the router"
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_openai_client_completion_streaming(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    stream = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                       temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) >= 2 and "".join(pieces), pieces


def test_openai_client_chat_streaming_and_not(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something"}]
    reply = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                           max_tokens=6, temperature=0)
    assert reply.choices[0].message.content is not None
    stream = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                            max_tokens=6, temperature=0, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == reply.choices[0].message.content, "greedy: same text both ways"


def test_over_long_prompt_is_refused_by_the_router_with_the_real_tokenizer(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello world " * 400, max_tokens=4)
    assert "context" in str(info.value)
    assert httpx.get(router + "/health").status_code == 200


@pytest.mark.parametrize(("prompt_tokens", "max_tokens", "status"), [
    (505, 1, 200), (506, 1, 400), (500, 10, 200), (500, 11, 400)])
def test_the_context_edges_are_sglangs_and_refused_in_the_routers_words(
        router: str, prompt_tokens: int, max_tokens: int, status: int) -> None:
    """--context-length 512: SGLang refuses a prompt of 506 tokens or more ("Input length (506
    tokens) exceeds the maximum allowed length", in its words, #39 finding 5) and clips a
    request's new tokens to 510 - prompt. The router refuses both first, with the context's
    limits in its message; what it lets through is served whole."""
    body = {"model": "tiny", "prompt": list(range(1, prompt_tokens + 1)),
            "max_tokens": max_tokens, "ignore_eos": True}
    reply = httpx.post(router + "/v1/completions", timeout=120, json=body)
    assert reply.status_code == status, reply.text
    if status == 200:
        assert reply.json()["usage"]["completion_tokens"] == max_tokens, "served whole"
        return
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert "a prompt of at most 505" in error["message"], error
    # the control: SGLang itself refuses it, or clips it short (the router is not stricter)
    direct = httpx.post(RUNTIME_URL[router] + "/v1/completions", timeout=120, json=body)
    assert direct.status_code == 400 or \
        direct.json()["usage"]["completion_tokens"] < max_tokens, direct.text


def test_streamed_requests_feed_ttft_and_tpot_metrics(router: str) -> None:
    text = httpx.get(router + "/metrics").text
    count = next(line for line in text.splitlines()
                 if line.startswith('fineslab_ttft_seconds_count{model="tiny"}'))
    assert float(count.split()[-1]) >= 2, count
    assert 'fineslab_tpot_seconds_count{model="tiny"}' in text


# -- a client that leaves (issue #35, finding 2) -------------------------------------------------
# The runtime is paused (SGLang's /pause_generation, in place), so a request stays in it until
# it is aborted: without the fix the router held the slot and SGLang the request for as long as
# the answer took (upstream_timeout_s, 600 s, for one that never came).


def _runtime_aborts(runtime_url: str) -> float:
    """Requests the runtime has aborted (SGLang's tokenizer counts each as it sends the abort
    to its scheduler: a paused scheduler publishes no fresh load figures)."""
    return sum(float(m.split()[-1]) for m in httpx.get(runtime_url + "/metrics", timeout=10)
               .text.splitlines() if m.startswith("sglang:num_aborted_requests_total"))


def _inflight(router: str, model: str) -> int:
    health = httpx.get(router + "/health", timeout=10).json()
    return sum(int(r["inflight"]) for r in health["models"][model])


def _queued(router: str, model: str) -> float:
    line = next(m for m in httpx.get(router + "/metrics", timeout=10).text.splitlines()
                if m.startswith(f'fineslab_queue_length{{model="{model}"}}'))
    return float(line.split()[-1])


def _abandoned(router: str, model: str) -> float:
    line = next(m for m in httpx.get(router + "/metrics", timeout=10).text.splitlines()
                if m.startswith(f'fineslab_requests_abandoned_total{{model="{model}"}}'))
    return float(line.split()[-1])


def _until(what: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.1)
    return what()


class _Client:
    """A client that sends one completion request and leaves (closes its connection) when
    told, not on a timer: on a loaded machine a timer can fire before the test looks."""

    def __init__(self, router: str, model: str, stream: bool) -> None:
        url = httpx.URL(router)
        body = json.dumps({"model": model, "prompt": "Tell me a long story", "max_tokens": 32,
                           "stream": stream}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        self._socket = socket.create_connection((url.host, url.port), timeout=30)
        self._socket.sendall(head.encode() + body)

    def leave(self) -> None:
        self._socket.close()


@contextlib.contextmanager
def _paused(runtime_url: str) -> Iterator[None]:
    reply = httpx.post(runtime_url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
    assert reply.status_code == 200, reply.text
    try:
        yield
    finally:
        httpx.post(runtime_url + "/continue_generation", json={}, timeout=30)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_leaves_frees_its_router_slot_and_its_runtime_request(
        router: str, stream: bool) -> None:
    runtime = RUNTIME_URL[router]
    before, aborts = _abandoned(router, "tiny"), _runtime_aborts(runtime)
    with _paused(runtime):
        client = _Client(router, "tiny", stream)
        assert _until(lambda: _inflight(router, "tiny") == 1, 10), "the request was forwarded"
        client.leave()
        assert _until(lambda: _inflight(router, "tiny") == 0, 5), "the router slot is free"
        assert _until(lambda: _runtime_aborts(runtime) == aborts + 1, 2), \
            "the runtime aborted it (SGLang's own disconnect check alone takes up to 4 s)"
    assert _abandoned(router, "tiny") == before + 1
    reply = httpx.post(router + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert reply.status_code == 200, reply.text


def test_a_client_that_leaves_while_queued_leaves_the_queue(router: str) -> None:
    runtime = RUNTIME_URL[router]
    with _paused(runtime):
        holder = _Client(router, "tiny-one", False)
        assert _until(lambda: _inflight(router, "tiny-one") == 1, 10)
        waiter = _Client(router, "tiny-one", True)
        assert _until(lambda: _queued(router, "tiny-one") == 1, 10), "the second one waits"
        aborts = _runtime_aborts(runtime)
        waiter.leave()
        assert _until(lambda: _queued(router, "tiny-one") == 0, 5), "it left the queue"
        assert _inflight(router, "tiny-one") == 1, "the first one still holds the slot"
        assert _runtime_aborts(runtime) == aborts, "the one that left never reached the runtime"
        holder.leave()
        assert _until(lambda: _inflight(router, "tiny-one") == 0, 5)
        assert _until(lambda: _runtime_aborts(runtime) == aborts + 1, 2), "only the first ran"


def test_a_client_that_closes_once_it_has_read_done_was_served_not_abandoned(
        router: str) -> None:
    """Clients (the benchmark's, many SDKs) close as soon as they read `data: [DONE]`, often
    before the runtime's stream has ended: that answer was served whole. No abandon is counted,
    no abort is sent, and the router logs no error for it."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(handler)
    runtime = RUNTIME_URL[router]
    before, aborts = _abandoned(router, "tiny"), _runtime_aborts(runtime)
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": True}
        with httpx.Client(timeout=60) as client:
            for _ in range(12):
                with client.stream("POST", router + "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200
                    lines = reply.iter_lines()
                    assert any(line == "data: [DONE]" for line in lines)
                    reply.close()  # at once, while the router may still wait for the end
        assert _until(lambda: _inflight(router, "tiny") == 0, 5)
    finally:
        server_log.removeHandler(handler)
    assert _abandoned(router, "tiny") == before
    assert _runtime_aborts(runtime) == aborts
    assert errors == [], [e.getMessage() for e in errors]

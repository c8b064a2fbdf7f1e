"""Hostile requests at the router (issue #15): each case names the defect it guards against.

Against a real router and a real local HTTP backend (the echo backend, which records nothing
and answers at once); the cases a real SGLang runtime choked on are also sent to real
runtimes in test_demo_fleet.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fineslab.errors import ConfigError
from fineslab.router import (
    ModelRoute,
    ReplicaRoute,
    Router,
    RouterServer,
    RouterSettings,
    TokenBudget,
)
from fineslab.router.app import INLINE_PARSE_BYTES
from fineslab.router.requests import check_budget
from fineslab.router.testing import FixedTtftPredictor, start_echo_backend
from fineslab.router.validation import BadRequest
from fineslab.runtime import free_port

VOCAB = 2048
ONE_MIB = 1024 * 1024


@pytest.fixture(scope="module")
def backend_url() -> Iterator[str]:
    port = free_port()
    proc = start_echo_backend(port)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def _route(name: str, url: str, tokenizer_dir: str | None = None,
           context_tokens: int = 256, budget: TokenBudget | None = None) -> ModelRoute:
    return ModelRoute(name, (ReplicaRoute(f"{name}-r0", url),), 30.0, FixedTtftPredictor(),
                      tokenizer_dir=tokenizer_dir, context_tokens=context_tokens,
                      vocab_size=VOCAB, token_budget=budget)


@pytest.fixture(scope="module")
def router(backend_url: str, model_cache: Path) -> Iterator[RouterServer]:
    routes = [_route("m", backend_url),
              # a real tokenizer and a context too long for any prompt here to be refused
              _route("big", backend_url, str(model_cache / "llama-tiny"), 10**9),
              _route("dead", "http://127.0.0.1:9"),
              # runtimes of --max-total-tokens 256, page 16, under a longer context
              _route("budget", backend_url, context_tokens=4096, budget=TokenBudget(256, 16))]
    server = RouterServer(Router(routes, RouterSettings(max_body_bytes=4 * ONE_MIB)))
    server.start()
    server.router.mark_down("dead-r0")
    yield server
    server.stop()


def _post(router: RouterServer, body: object, raw: bytes | None = None,
          client: httpx.Client | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    poster = client or httpx
    return poster.post(router.base_url + "/v1/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})


def _assert_error(reply: httpx.Response, status: int, code: str | None = None) -> str:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}, f"one error shape: {error}"
    if code is not None:
        assert error["code"] == code, error
    message = str(error["message"])
    for leak in ("Traceback", "/site-packages/", ".venv", "pydantic", "range() arg"):
        assert leak not in message, f"internal detail {leak!r} in {message!r}"
    return message


@pytest.mark.parametrize("ids", [[1, VOCAB], [1, 4096], [-1], [1, 2**40], [1, True], [1, 2.0]])
def test_token_id_past_the_vocabulary_is_400_not_a_dead_runtime(router: RouterServer,
                                                                 ids: list[object]) -> None:
    # Defect 1: [1, 4096] reached SGLang's scheduler and ended in an IndexError that killed it.
    message = _assert_error(_post(router, {"model": "m", "prompt": ids, "max_tokens": 2}),
                            400, "invalid_token_id")
    assert f"[0, {VOCAB})" in message


def test_the_last_token_id_of_the_vocabulary_is_served(router: RouterServer) -> None:
    reply = _post(router, {"model": "m", "prompt": [0, VOCAB - 1], "max_tokens": 2})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(("raw", "what"), [
    (b'{"model": "m", "prompt": "\\ud800", "max_tokens": 2}', "Unicode"),
    (b'{"model": "m", "prompt": "x", "stop": ["\\udfff"]}', "Unicode"),
    (b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 10000 + b"]" * 10000 + b"}", "nest"),
    (b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 100 + b"]" * 100 + b"}", "nest"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', "Infinity"),
])
def test_valid_json_that_crashed_the_router_is_400_and_keeps_the_connection(
        router: RouterServer, raw: bytes, what: str) -> None:
    # Defect 3: a lone surrogate or 10,000 nested [ gave 500 text/plain and reset the
    # connection, so the next request on it failed too.
    with httpx.Client() as client:
        assert what in _assert_error(_post(router, None, raw, client), 400)
        again = _post(router, {"model": "m", "prompt": "x", "max_tokens": 1}, client=client)
        assert again.status_code == 200, "the keep-alive connection still serves"


@pytest.mark.parametrize(("field", "value", "param"), [
    ("n", 0, "n"), ("n", 10**6, "n"), ("max_tokens", 0, "max_tokens"),
    ("max_tokens", True, "max_tokens"), ("temperature", -1, "temperature"),
    ("temperature", "hot", "temperature"), ("top_p", 0, "top_p"), ("top_k", 0, "top_k"),
    ("logprobs", 1000, "logprobs"), ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("logit_bias", {"99999": 1}, "logit_bias"), ("logit_bias", {"x": 1}, "logit_bias"),
    ("min_tokens", 9, "min_tokens"), ("stream", "yes", "stream"), ("seed", 2**70, "seed"),
])
def test_out_of_range_fields_are_400_naming_the_field(router: RouterServer, field: str,
                                                      value: object, param: str) -> None:
    # Defect 9: n=0 answered `range() arg 3 must not be zero`, max_tokens 0 a pydantic dump.
    body = {"model": "m", "prompt": "x", "max_tokens": 4, field: value}
    reply = _post(router, body)
    _assert_error(reply, 400)
    assert reply.json()["error"]["param"] == param


def test_unknown_path_and_wrong_method_have_the_openai_error_shape(router: RouterServer) -> None:
    # Defect 9: FastAPI's {"detail": ...} for 404/405.
    _assert_error(httpx.get(router.base_url + "/v1/nothing", timeout=10), 404, "not_found")
    _assert_error(httpx.get(router.base_url + "/v1/completions", timeout=10), 405,
                  "method_not_allowed")


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/health/m", "/metrics"])
def test_head_of_a_get_endpoint_answers_like_its_get_without_a_body(
        router: RouterServer, path: str) -> None:
    # Issue #39: HEAD /v1/models answered 405 with an empty body.
    got = httpx.get(router.base_url + path, timeout=10)
    head = httpx.head(router.base_url + path, timeout=10)
    assert head.status_code == got.status_code == 200, (head.status_code, got.status_code)
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


def test_a_runtime_error_is_rewritten_without_its_paths(router: RouterServer) -> None:
    # Defect 9: SGLang's own error shape, with a path of its venv, passed through.
    path = "/work/main/.venv/lib/python3.11/site-packages/sglang/srt/x.py"
    reply = _post(router, {"model": "m", "prompt": "x", "echo_status": 400,
                           "echo_message": f"template failed in {path}"})
    message = _assert_error(reply, 400, "runtime_rejected")
    assert "template failed in <path>" in message
    _assert_error(_post(router, {"model": "m", "prompt": "x", "echo_status": 500,
                                 "echo_message": "boom"}), 502, "runtime_failed")


def test_a_body_over_the_limit_is_413(router: RouterServer) -> None:
    # Defect 7: no body limit.
    _assert_error(_post(router, None, b'{"model": "m", "prompt": "' + b"x" * (5 * ONE_MIB)
                        + b'"}'), 413, "request_too_large")


def test_large_prompts_are_tokenized_off_the_event_loop(router: RouterServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Defect 7: tokenization ran on the event loop: 8 concurrent 3 MB prompts took /health
    # from 0.02 s to 4.6 s. Bodies over INLINE_PARSE_BYTES are now parsed and tokenized on the
    # router's parse pool, whose threads release the loop (the tokenizer drops the GIL).
    counter = router.router.counters["big"]
    threads: list[str] = []
    count_text = counter.count_text

    def recording(text: str, limit_tokens: int | None = None) -> int:
        threads.append(threading.current_thread().name)
        return count_text(text, limit_tokens)

    monkeypatch.setattr(counter, "count_text", recording)
    big = {"model": "big", "prompt": "the slab arena " * 5_000, "max_tokens": 1}
    assert len(json.dumps(big)) > INLINE_PARSE_BYTES
    assert _post(router, big).status_code == 200
    assert _post(router, {"model": "big", "prompt": "short", "max_tokens": 1}).status_code == 200
    assert threads[0].startswith("fineslab-parse"), threads
    assert threads[1] == "fineslab-router", "small bodies stay on the loop (no thread hop)"


def test_a_prompt_far_past_the_context_is_refused_without_tokenizing_it(
        router: RouterServer, model_cache: Path) -> None:
    from fineslab.router.requests import PromptCounter

    counter = PromptCounter(str(model_cache / "llama-tiny"))
    assert counter.max_chars_per_token is not None
    text = "x" * (counter.max_chars_per_token * 300)
    assert counter.count_text(text, limit_tokens=299) == 300, "the bound, not a tokenization"
    assert counter.count_text("the slab", limit_tokens=299) == len(
        counter.count_text("the slab") * [0]), "short texts are tokenized"


def test_health_is_degraded_not_503_while_any_model_serves(router: RouterServer) -> None:
    # Defect 4: one dead model turned the whole fleet's /health 503 while others served.
    reply = httpx.get(router.base_url + "/health", timeout=10)
    assert reply.status_code == 200 and reply.json()["status"] == "degraded", reply.text
    assert reply.json()["model_status"] == {"m": "serving", "big": "serving", "dead": "down",
                                            "budget": "serving"}
    assert httpx.get(router.base_url + "/health/m", timeout=10).status_code == 200
    dead = httpx.get(router.base_url + "/health/dead", timeout=10)
    assert dead.status_code == 503 and dead.json()["status"] == "down"
    _assert_error(httpx.get(router.base_url + "/health/nope", timeout=10), 404)


@pytest.mark.parametrize(("prompt_tokens", "max_tokens", "status", "said"), [
    (224, 15, 200, None),
    (224, 16, 400, "at most 15 more fit"),
    (240, 1, 400, "no token more fits"),  # SGLang would clip it to none and queue it for ever
    (241, 1, 400, "no token more fits"),  # its pages fill the budget: SGLang never admits it
    (251, 1, 400, "no token more fits"),  # SGLang's own 400, in SGLang's words
    (100, 200, 400, "at most 127 more fit"),  # pages: 256 - 112 - 16 - 1
])
def test_a_request_over_the_runtimes_token_budget_is_400_at_once(
        router: RouterServer, prompt_tokens: int, max_tokens: int, status: int,
        said: str | None) -> None:
    # Issue #35, finding 1: under --max-total-tokens 1024 a 1,010-token prompt was forwarded
    # (the context was 4,096) and never answered.
    reply = _post(router, {"model": "budget", "prompt": list(range(1, prompt_tokens + 1)),
                           "max_tokens": max_tokens})
    if status == 200:
        assert reply.status_code == 200, reply.text
        return
    message = _assert_error(reply, 400, "context_length_exceeded")
    assert said in message and "256 KV tokens" in message, message


def test_a_kv_limit_smaller_than_the_budget_refuses_what_it_can_never_hold() -> None:
    """`fineslab ctl limit` caps a runtime's KV below its --max-total-tokens: a request over
    what the limit can ever hold waited in SGLang's queue until its client gave up (a 1,500-token
    prompt under a 576-token limit, bench.capacity's static partitions). The route's budget is
    the smaller one, read per request (a limit changes at run time); with no limit, or a limit
    above the budget, the budget stands."""
    limits: dict[str, TokenBudget | None] = {"r0": None}
    route = ModelRoute("m", (ReplicaRoute("r0", "http://127.0.0.1:9"),), 30.0,
                       FixedTtftPredictor(), tokenizer_dir=None, context_tokens=4096,
                       token_budget=TokenBudget(1024, 16), kv_limit_budget=limits.get)
    assert route.budget() == TokenBudget(1024, 16)
    limits["r0"] = TokenBudget(576, 16, "its KV limit of 1179648 B, fineslab ctl limit")
    assert route.budget() == limits["r0"]
    with pytest.raises(BadRequest, match="KV limit of 1179648 B"):
        check_budget(route.budget(), 1500, 8)
    check_budget(route.budget(), 500, 8)
    limits["r0"] = TokenBudget(4096, 16, "a limit above the budget")
    assert route.budget() == TokenBudget(1024, 16)
    two = dataclasses.replace(route, replicas=(*route.replicas, ReplicaRoute("r1", "x")))
    limits["r0"] = TokenBudget(576, 16)
    assert two.budget() == TokenBudget(1024, 16), "a runtime without a limit takes any request"


def test_the_token_budget_follows_sglangs_clip() -> None:
    budget = TokenBudget(1024, 16)
    # SGLang: min(max_req_len - n - 1, capacity - pages(n) - page - 1), max_req_len = 1023
    assert [budget.most_new_tokens(n) for n in (1000, 992, 500)] == [-1, 15, 495]
    assert budget.longest_prompt == 1018, "SGLang's own refusal: over 1018 input tokens"
    assert TokenBudget(1024, 1).most_new_tokens(1010) == 12, "page 1: SGLang's own pool"
    with pytest.raises(ConfigError):
        TokenBudget(0)


@pytest.mark.parametrize("role", ["user", "system"])
def test_a_null_content_is_refused_in_the_routers_words(router: RouterServer, role: str) -> None:
    """SGLang answered a user message with `content: null` with the list of allowed roles
    (#39 finding 5); an assistant message may leave it null (tool calls)."""
    messages = [{"role": role, "content": None}]
    reply = httpx.post(router.base_url + "/v1/chat/completions", timeout=30,
                       json={"model": "m", "messages": messages, "max_tokens": 2})
    assert "messages[0].content is required" in _assert_error(reply, 400)
    served = httpx.post(router.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "and?"}]})
    assert served.status_code == 200, served.text

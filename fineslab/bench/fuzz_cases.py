"""The request bodies of `fineslab.bench.fuzz`: fixed hostile cases and hypothesis draws.

Each case is (method, path or None for either completions endpoint, body bytes). The drawn
bodies are OpenAI-shaped objects in which any field may be missing, of another type, out of
range or hostile text (lone surrogates, control characters), plus raw byte strings. A
hypothesis `given` run with a fixed seed collects them, so a seed reproduces a run.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: Valid requests get at most this many new tokens (real runtimes answer fast).
MAX_NEW_TOKENS = 8
ONE_MIB = 1024 * 1024

Case = tuple[str, str | None, bytes]


def hostile_cases(models: list[str]) -> list[Case]:
    """The requests that broke the router or a runtime before (issue #15)."""
    m = models[0]

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": m, "max_tokens": 2, **fields}).encode()

    return [
        ("POST", "/v1/completions", body(prompt=[1, 10**6])),
        ("POST", "/v1/completions", body(prompt=[1, -1])),
        ("POST", "/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}' % m.encode()),
        ("POST", "/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", '
                                         b'"content": "\\udfff"}]}' % m.encode()),
        ("POST", "/v1/completions", b'{"model": "%s", "prompt": "x", "n": ' % m.encode()
         + b"[" * 10000 + b"]" * 10000 + b"}"),
        ("POST", "/v1/completions", body(prompt="hi", n=0)),
        ("POST", "/v1/completions", body(prompt="hi", max_tokens=0)),
        ("POST", "/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": NaN}'
         % m.encode()),
        ("POST", "/v1/completions", b'{"model": "%s", "prompt": "x", "max_tokens": 1e999}'
         % m.encode()),
        ("POST", "/v1/completions", b'{"model": "%s", "prompt": "' % m.encode()
         + b"x" * (5 * ONE_MIB) + b'"}'),
        ("POST", "/v1/chat/completions", body(messages=[{"role": "wizard", "content": "x"}])),
        ("GET", "/v1/completions", b""),
        ("POST", "/v1/nothing", b"{}"),
        ("DELETE", "/health", b""),
    ]


_TEXT = st.text(alphabet=st.characters(codec=None, categories=None), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\ud800", "\udfff\ud800", "x" * 3000, "<|endoftext|>", "{{ raise }}"])
_NUMBER = (st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, 1, -1, 2, 0.5, 1e308, -0.0]))
_ANY = st.recursive(st.none() | st.booleans() | _NUMBER | _TEXT,
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=8)
_TOKEN_IDS = st.lists(st.integers(-5, 5000) | st.sampled_from([2**31, 2**63, True, 1.5, "1"]),
                      max_size=6)


def _field(valid: st.SearchStrategy[Any],
           hostile: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Any]:
    """A field's value: valid 17 draws in 20, out of range 2 (when given), anything 1."""
    def pick(i: int) -> st.SearchStrategy[Any]:
        if i == 0:
            return _ANY
        if i <= 2 and hostile is not None:
            return hostile
        return valid
    return st.integers(0, 19).flatmap(pick)


_UNIT = st.floats(0.0, 1.0)


def _messages() -> st.SearchStrategy[Any]:
    message = st.fixed_dictionaries(
        {"role": _field(st.sampled_from(["user", "system", "assistant"]), _TEXT),
         "content": _field(st.text(max_size=40) | st.lists(st.fixed_dictionaries(
             {"type": st.just("text"), "text": st.text(max_size=20)}), min_size=1, max_size=2),
             _TEXT)})
    return _field(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=0))


def _body(models: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    optional = {
        "max_tokens": _field(st.integers(1, MAX_NEW_TOKENS), st.integers(-3, 10**6)),
        "n": _field(st.integers(1, 2), st.integers(-2, 40)),
        "temperature": _field(st.floats(0.0, 2.0), _NUMBER),
        "top_p": _field(st.floats(0.01, 1.0), _NUMBER),
        "top_k": _field(st.integers(1, 50) | st.just(-1), st.integers(-3, 0)),
        "min_p": _field(_UNIT, _NUMBER), "seed": _field(st.integers(0, 2**31), _NUMBER),
        "presence_penalty": _field(st.floats(-2.0, 2.0), _NUMBER),
        "frequency_penalty": _field(st.floats(-2.0, 2.0), _NUMBER),
        "repetition_penalty": _field(st.floats(0.5, 2.0), _NUMBER),
        "stop": _field(st.text(min_size=1, max_size=4) | st.lists(
            st.text(min_size=1, max_size=4), max_size=4), st.lists(_TEXT, max_size=6)),
        "stream": _field(st.booleans()),
        "top_logprobs": _field(st.integers(0, 5), st.integers(-2, 50)),
        "echo": _field(st.booleans()),
        "logit_bias": _field(st.dictionaries(st.integers(0, 2000).map(str),
                                             st.floats(-100, 100), max_size=3),
                             st.dictionaries(st.integers(-5, 10**6).map(str), _NUMBER,
                                             max_size=3)),
        "min_tokens": _field(st.integers(0, 2), st.integers(-2, 100)),
        "user": _field(st.text(max_size=10)),
        "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    }
    prompt = _field(st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 2000),
                                                                min_size=1, max_size=8),
                    _TEXT | _TOKEN_IDS | st.lists(_TEXT, max_size=2))
    return st.fixed_dictionaries(
        {"model": _field(st.sampled_from(models), _TEXT), "prompt": prompt,
         "messages": _messages()}, optional=optional)


def _cap(body: dict[str, Any], context: int) -> dict[str, Any]:
    """Keep generation short where the request would be served: a plausible max_tokens above
    MAX_NEW_TOKENS but within the context becomes MAX_NEW_TOKENS (larger ones stay: refused).
    A missing or null max_tokens becomes MAX_NEW_TOKENS too: a chat request without one
    generates up to the context (found by a long run: minutes-long answers, client timeouts)."""
    value = body.get("max_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and MAX_NEW_TOKENS < value <= context:
        body["max_tokens"] = MAX_NEW_TOKENS
    if body.get("max_tokens") is None:
        body["max_tokens"] = MAX_NEW_TOKENS
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_NEW_TOKENS:
        body["min_tokens"] = MAX_NEW_TOKENS
    return body


def _encode(body: dict[str, Any]) -> bytes:
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity as Python writes them
    return text.encode("utf-8", errors="surrogatepass")


def random_cases(models: list[str], contexts: dict[str, int], count: int, seed: int,
                 ) -> list[Case]:
    """`count` drawn cases: four in five JSON bodies, one in five raw bytes."""
    drawn: list[Case] = []
    raw = st.binary(max_size=200) | st.sampled_from(
        [b"", b"{", b"[1,2]", b'{"model": 1e400}', b'{"model": "' + models[0].encode() + b'"',
         b"\xff\xfe", b'{"a":' * 50 + b"1" + b"}" * 50])
    case = st.tuples(st.integers(0, 4), _body(models), raw)

    @settings(max_examples=count, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case)
    def collect(item: tuple[int, dict[str, Any], bytes]) -> None:
        if len(drawn) >= count:
            return
        kind, body, raw_bytes = item
        if kind == 0:
            drawn.append(("POST", None, raw_bytes))
            return
        model = body.get("model")
        context = contexts.get(model, 2048) if isinstance(model, str) else 2048
        drawn.append(("POST", None, _encode(_cap(body, context))))

    import hypothesis

    hypothesis.seed(seed)(collect)()
    assert all(isinstance(c[2], bytes) for c in drawn)
    return drawn[:count]

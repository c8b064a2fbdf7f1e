"""What the router checks in a request body so that no runtime ever sees what it could choke on.

Every check here stands for a way a request reached SGLang 0.5.23 and failed there: a token id
past the vocabulary ended in an `IndexError` in its scheduler and the runtime exited; `n: 0`
answered `range() arg 3 must not be zero`; `max_tokens: 0` a pydantic dump; a lone surrogate
(`"\\ud800"`, valid JSON) or 10,000 nested `[` a 500. The router answers each with a 400 in
the one OpenAI error shape, naming the field, before the request is queued.

    body      JSON object, nesting depth <= MAX_JSON_DEPTH, every string valid Unicode,
              no NaN / Infinity
    sampling  each field of `SAMPLING_FIELDS` of its type and in its range (OpenAI's ranges,
              narrowed where SGLang's are narrower)
    tokens    every prompt token id and `logit_bias` key in [0, vocab_size)

Fields the router does not know are passed through untouched (clients send many), except
SGLang's `priority`, which the router owns (`proxy.runtime_body`: removed, or set to the
request's deadline when the runtimes schedule by deadline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: OpenAI bodies nest a few levels (messages[i].content[j].image_url.url, tool schemas a few
#: more); 10,000 levels made the JSON parser recurse out of its stack.
MAX_JSON_DEPTH = 64
#: Completions per request (`n`); each is a full generation on the runtime.
MAX_N = 16
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 20


class BadRequest(Exception):
    """The request body is malformed; the message goes back to the client with a 400."""

    def __init__(self, message: str, code: str = "invalid_request",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class NumberField:
    """A sampling field: integer or real, within [low, high] (`open_low`: low excluded)."""

    name: str
    low: float
    high: float
    integer: bool = False
    open_low: bool = False

    def check(self, value: object) -> None:
        kind = "an integer" if self.integer else "a number"
        ok_type = _is_int(value) if self.integer else _is_number(value)
        if ok_type:
            number = float(value)  # type: ignore[arg-type]
            above = number > self.low if self.open_low else number >= self.low
            if above and number <= self.high:
                return
        bracket = "(" if self.open_low else "["
        raise BadRequest(f"`{self.name}` must be {kind} in {bracket}{self.low:g}, "
                         f"{self.high:g}], got {_show(value)}", param=self.name)


SAMPLING_FIELDS: tuple[NumberField, ...] = (
    NumberField("temperature", 0.0, 2.0),
    NumberField("top_p", 0.0, 1.0, open_low=True),
    NumberField("min_p", 0.0, 1.0),
    NumberField("presence_penalty", -2.0, 2.0),
    NumberField("frequency_penalty", -2.0, 2.0),
    NumberField("repetition_penalty", 0.0, 2.0, open_low=True),
    NumberField("n", 1, MAX_N, integer=True),
    NumberField("best_of", 1, MAX_N, integer=True),
    NumberField("seed", -(2**63), 2**63 - 1, integer=True),
    NumberField("top_logprobs", 0, MAX_LOGPROBS, integer=True),
)

BOOL_FIELDS = ("stream", "echo", "ignore_eos", "skip_special_tokens", "logprobs_chat")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_structure(body: object) -> None:
    """Depth and Unicode of a parsed body, walked without recursion."""
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest("the body holds a string that is not valid Unicode (a lone "
                                 "surrogate such as \\ud800)") from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((item, depth + 1))


def check_sampling(body: dict[str, Any], chat: bool) -> None:
    for field in SAMPLING_FIELDS:
        if body.get(field.name) is not None:
            field.check(body[field.name])
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and (top_k == -1 or 1 <= top_k <= 2**31)):
        raise BadRequest(f"`top_k` must be -1 (off) or a positive integer, got {_show(top_k)}",
                         param="top_k")
    for name in BOOL_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequest(f"`{name}` must be a boolean", param=name)
    _check_logprobs(body, chat)
    _check_stop(body.get("stop"))
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise BadRequest("`stream_options` must be an object", param="stream_options")


def _check_logprobs(body: dict[str, Any], chat: bool) -> None:
    logprobs = body.get("logprobs")
    if logprobs is None:
        return
    if chat and not isinstance(logprobs, bool):
        raise BadRequest("`logprobs` must be a boolean in a chat request", param="logprobs")
    if not chat and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"`logprobs` must be an integer in [0, {MAX_LOGPROBS}]",
                         param="logprobs")


def _check_stop(stop: object) -> None:
    if stop is None or isinstance(stop, str):
        return
    if (isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES
            and all(isinstance(s, str) and s for s in stop)):
        return
    raise BadRequest(f"`stop` must be a string or a list of at most {MAX_STOP_SEQUENCES} "
                     "non-empty strings", param="stop")


def check_token_ids(ids: list[Any], vocab_size: int | None, what: str) -> None:
    """Every id an int in [0, vocab_size) (only the type when the vocabulary is unknown)."""
    limit = vocab_size if vocab_size is not None else 2**31
    for i, token in enumerate(ids):
        if not _is_int(token) or not 0 <= token < limit:
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, 2^31)"
            raise BadRequest(f"{what}[{i}] = {_show(token)} is not a token id of this model "
                             f"(ids are integers in {bound})", code="invalid_token_id",
                             param=what)


def check_logit_bias(bias: object, vocab_size: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BadRequest("`logit_bias` must be an object of token id -> bias",
                         param="logit_bias")
    ids = []
    for key, value in bias.items():
        if not key.lstrip("-").isdigit() or len(key) > 12:
            raise BadRequest(f"`logit_bias` key {_show(key)} is not a token id",
                             param="logit_bias")
        ids.append(int(key))
        if not _is_number(value) or not -100 <= value <= 100:
            raise BadRequest("`logit_bias` values must be numbers in [-100, 100]",
                             param="logit_bias")
    check_token_ids(ids, vocab_size, "logit_bias")


def reject_constant(name: str) -> object:
    """`json.loads(parse_constant=...)`: NaN and Infinity are Python's extension, not JSON."""
    raise BadRequest(f"the body holds {name}, which is not a JSON number")

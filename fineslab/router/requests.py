"""Reading an OpenAI request at the router: validation and prompt length, before any queueing.

The router must know a request's prompt tokens to schedule it (Algorithm 2 works on prompt
lengths) and to refuse an over-long prompt with a 400 before it waits in a queue. It counts
with the model's own `tokenizer.json` (the `tokenizers` library, about 20 us for a short
prompt). Chat prompts are counted as the sum of the message contents plus
`CHAT_TOKENS_PER_MESSAGE` for the role markers of the template: an estimate within a few tokens,
which is what the scheduler needs; the runtime applies the real template.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHAT_TOKENS_PER_MESSAGE = 4
#: Characters per token when a model has no tokenizer.json (a fast, rough fallback).
CHARS_PER_TOKEN_FALLBACK = 4


class BadRequest(Exception):
    """The request body is malformed; the message goes back to the client with a 400."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int


class PromptCounter:
    """Counts prompt tokens with a model's tokenizer (loaded once)."""

    def __init__(self, tokenizer_dir: str | None) -> None:
        self._tokenizer = None
        path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        elif tokenizer_dir:
            logger.warning("no tokenizer.json in %s; prompt lengths are estimated from "
                           "characters", tokenizer_dir)

    def count_text(self, text: str) -> int:
        if self._tokenizer is None:
            return max(1, len(text) // CHARS_PER_TOKEN_FALLBACK)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count_completion_prompt(self, prompt: object) -> int:
        if isinstance(prompt, str):
            return self.count_text(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            raise BadRequest("a batch of prompts in one request is not supported by the "
                             "router; send one request per prompt")
        raise BadRequest("`prompt` must be a string or a list of token ids")

    def count_chat(self, messages: object) -> int:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list")
        total = 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise BadRequest(f"messages[{i}] must be an object with a `role`")
            content = message.get("content")
            if isinstance(content, list):  # content parts: count the text ones
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            if content is not None and not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
            total += self.count_text(content or "") + CHAT_TOKENS_PER_MESSAGE
        return total


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("`model` (a string) is required")
    return body


def read_request(body: dict[str, Any], counter: PromptCounter, chat: bool,
                 context_tokens: int) -> ParsedRequest:
    """Validate the fields the router relies on; BadRequest (400) on anything malformed."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean")
    max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body
                          else "max_tokens", 16 if not chat else 0)
    if max_tokens is None:
        max_tokens = 0
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise BadRequest("`max_tokens` must be a non-negative integer")
    if chat:
        prompt_tokens = counter.count_chat(body.get("messages"))
    else:
        if "prompt" not in body:
            raise BadRequest("`prompt` is required")
        prompt_tokens = counter.count_completion_prompt(body["prompt"])
    if prompt_tokens + max_tokens > context_tokens:
        raise BadRequest(
            f"this model's context is {context_tokens} tokens; the prompt has {prompt_tokens} "
            f"and max_tokens asks for {max_tokens} more", code="context_length_exceeded")
    return ParsedRequest(body, body["model"], stream, prompt_tokens, max_tokens)

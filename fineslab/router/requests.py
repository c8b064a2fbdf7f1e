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

from fineslab.router.routes import TokenBudget
from fineslab.router.validation import (
    BadRequest,
    check_logit_bias,
    check_sampling,
    check_structure,
    check_token_ids,
    reject_constant,
)

logger = logging.getLogger(__name__)

CHAT_TOKENS_PER_MESSAGE = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: Characters per token when a model has no tokenizer.json (a fast, rough fallback).
CHARS_PER_TOKEN_FALLBACK = 4


@dataclass(frozen=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int


class PromptCounter:
    """Counts prompt tokens with a model's tokenizer (loaded once).

    No token of the vocabulary spells more than `max_chars_per_token` characters, so a text
    of n characters has at least n / max_chars_per_token tokens: a text that long past the
    context is refused without tokenizing it (a 3 MB prompt takes seconds to tokenize).
    """

    def __init__(self, tokenizer_dir: str | None) -> None:
        self._tokenizer = None
        self.max_chars_per_token: int | None = None
        path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
            vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            self.max_chars_per_token = max((len(t) for t in vocab), default=None)
        elif tokenizer_dir:
            logger.warning("no tokenizer.json in %s; prompt lengths are estimated from "
                           "characters", tokenizer_dir)

    def count_text(self, text: str, limit_tokens: int | None = None) -> int:
        """Tokens of `text`; past `limit_tokens` possibly a lower bound, still past it."""
        if self._tokenizer is None:
            return max(1, len(text) // CHARS_PER_TOKEN_FALLBACK)
        if limit_tokens is not None and self.max_chars_per_token:
            at_least = -(-len(text) // self.max_chars_per_token)
            if at_least > limit_tokens:
                return at_least
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count_completion_prompt(self, prompt: object, vocab_size: int | None = None,
                                limit_tokens: int | None = None) -> int:
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("`prompt` is empty", param="prompt")
            return self.count_text(prompt, limit_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list))
                                                       for p in prompt):
            raise BadRequest("a batch of prompts in one request is not supported by the "
                             "router; send one request per prompt", param="prompt")
        if isinstance(prompt, list) and prompt:
            check_token_ids(prompt, vocab_size, "prompt")
            return len(prompt)
        raise BadRequest("`prompt` must be a non-empty string or list of token ids",
                         param="prompt")

    def count_chat(self, messages: object, limit_tokens: int | None = None) -> int:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list")
        total = 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
                raise BadRequest(f"messages[{i}] must be an object with a `role` of "
                                 f"{', '.join(CHAT_ROLES)}", param="messages")
            content = message.get("content")
            if content is None and message["role"] != "assistant":
                raise BadRequest(f"messages[{i}].content is required in a {message['role']} "
                                 "message: a string or a list of parts (only an assistant "
                                 "message may leave it null)", param="messages")
            if isinstance(content, list):  # content parts: count the text ones
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            if content is not None and not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of parts",
                                 param="messages")
            total += self.count_text(content or "", limit_tokens) + CHAT_TOKENS_PER_MESSAGE
            if limit_tokens is not None and total > limit_tokens:
                return total
        return total


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request, checked for what no runtime should see (validation.py)."""
    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("the body nests too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    check_structure(body)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("`model` (a string) is required", param="model")
    return body


def _max_tokens(body: dict[str, Any], chat: bool) -> int:
    """The completion budget asked for; 0 when a chat request leaves it to the runtime."""
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    value = body.get(name)
    if value is None:
        return 0 if chat else 16
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"`{name}` must be a positive integer, got {value!r:.40}", param=name)
    return value


def check_context(context_tokens: int, prompt_tokens: int, max_tokens: int) -> None:
    """BadRequest where SGLang would refuse the prompt or clip the completion for the model's
    context (`--context-length`): its longest request is the context less one token, its
    longest prompt five fewer (it refuses a prompt of `context - 6` tokens or more), and a
    request's new tokens stop one short of the longest request (`max_req_len - n - 1`)."""
    longest_prompt = context_tokens - 7
    most_new = context_tokens - 2 - prompt_tokens
    if prompt_tokens > longest_prompt or max_tokens > most_new:
        shown = prompt_tokens if prompt_tokens <= context_tokens else "more than that"
        raise BadRequest(
            f"this model's context is {context_tokens} tokens: a prompt of at most "
            f"{longest_prompt}, and prompt and max_tokens together at most "
            f"{context_tokens - 2}; the prompt has {shown}"
            + (f" and max_tokens asks for {max_tokens} more" if max_tokens else ""),
            code="context_length_exceeded")


def check_budget(budget: TokenBudget, prompt_tokens: int, max_tokens: int) -> None:
    """BadRequest where a runtime's token budget cannot hold the request: SGLang would refuse
    the prompt, clip the completion short of `max_tokens` (at least one token when it is 0,
    the runtime's choice), or queue a request clipped to nothing for ever."""
    room = budget.most_new_tokens(prompt_tokens)
    if prompt_tokens > budget.longest_prompt or (max_tokens or 1) > room:
        raise BadRequest(
            f"this model's runtimes hold {budget.total_tokens} KV tokens a request "
            f"({budget.set_by}, pages of {budget.page_size}); the prompt has {prompt_tokens}"
            + (f" and max_tokens asks for {max_tokens} more" if max_tokens else "")
            + (f": at most {room} more fit" if room > 0 else ": no token more fits"),
            code="context_length_exceeded")


def read_request(body: dict[str, Any], counter: PromptCounter, chat: bool,
                 context_tokens: int, vocab_size: int | None = None,
                 budget: TokenBudget | None = None) -> ParsedRequest:
    """Validate the fields the router relies on; BadRequest (400) on anything malformed."""
    check_sampling(body, chat)
    check_logit_bias(body.get("logit_bias"), vocab_size)
    stream = body.get("stream") or False
    max_tokens = _max_tokens(body, chat)
    if chat:
        prompt_tokens = counter.count_chat(body.get("messages"), context_tokens)
    else:
        if "prompt" not in body:
            raise BadRequest("`prompt` is required", param="prompt")
        prompt_tokens = counter.count_completion_prompt(body["prompt"], vocab_size,
                                                        context_tokens)
    check_context(context_tokens, prompt_tokens, max_tokens)
    if budget is not None:
        check_budget(budget, prompt_tokens, max_tokens)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and (not isinstance(min_tokens, int) or isinstance(min_tokens, bool)
                                   or not 0 <= min_tokens <= (max_tokens or context_tokens)):
        raise BadRequest("`min_tokens` must be an integer in [0, max_tokens]",
                         param="min_tokens")
    return ParsedRequest(body, body["model"], stream, prompt_tokens, max_tokens)

"""Prompts of a target token length, built from a seeded word stream.

With a tokenizer (a `tokenizer.json`, or a model folder holding one) the prompt is exact up to
BPE re-merging at the cut: the word stream is tokenized once, the first N token ids are decoded
back to text. Without one, common English words are about one token each in Llama-style
vocabularies, so N words are used; the server's reported `usage.prompt_tokens` is what the load
generator records either way.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from fineslab.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

WORDS = """the of and to in is was for on that with as by at from it an be this are or which
not have has had were but they their one all there can more been would will other when what who
also into some time out up may only new about these any could after first used two most many
such over very then like model memory block token cache layer batch request server client queue
latency throughput weight value key query attention prefill decode chunk page table owner free
device kernel tensor float scale zero error start stop signal metric router fleet replica
hello world question answer please thank you why how where tell me explain write story poem
code function class return import if else while""".split()  # noqa: SIM905 (reads as text)


class PromptBuilder:
    """`prompt(num_tokens)` -> text of about that many tokens (see the module docstring)."""

    def __init__(self, tokenizer_path: Path | None = None, seed: int = 0,
                 stream_words: int = 20000) -> None:
        rng = random.Random(seed)
        self._words = [rng.choice(WORDS) for _ in range(stream_words)]
        self._tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        self._ids: list[int] = []
        if self._tokenizer is not None:
            self._ids = list(self._tokenizer.encode(" ".join(self._words),
                                                    add_special_tokens=False).ids)

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    def prompt(self, num_tokens: int, offset: int = 0) -> str:
        """About `num_tokens` tokens; `offset` varies the text between requests (no prefix
        cache hits across requests)."""
        if num_tokens < 1:
            raise ConfigError(f"a prompt needs at least one token, got {num_tokens}")
        if self._tokenizer is not None:
            start = offset % max(1, len(self._ids) - num_tokens)
            ids = (self._ids * (1 + num_tokens // max(1, len(self._ids))))[start:start + num_tokens]
            return str(self._tokenizer.decode(ids))
        start = offset % max(1, len(self._words) - num_tokens)
        words = (self._words * (1 + num_tokens // len(self._words)))[start:start + num_tokens]
        return " ".join(words)


def _load_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"cannot load tokenizer {file}: {exc}") from exc

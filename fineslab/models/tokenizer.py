"""A byte-level BPE tokenizer trained here, deterministically, for the generated models.

No tokenizer can be downloaded on these machines, so each generated model gets one trained with
the `tokenizers` library on a corpus that is itself generated from a fixed seed. Training on about
200 kB of text takes well under a second. The vocabulary size is exact: the corpus is large enough
for the trainer to reach it, and `build_tokenizer` refuses to return a smaller one, because the
model's embedding table is sized from it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Words the corpus is drawn from: plain English plus some code and numbers, so that prompts in
# tests and demos tokenize into a realistic mix of merged and byte-level pieces.
_WORDS = """
the of and to in is was for on that with as by at from it an be this are or which not have has
had were but they their one all there can more been would will other when what who also into
some time out up may only new about these any could after first used two most many such over
very then such like model memory block slab token cache layer head batch request server client
serve queue deadline latency throughput precision weight value key query attention prefill
decode chunk page arena table owner free partial full carve return reclaim process device gpu
cpu kernel tensor float integer scale zero packed quantize round error warning info debug start
stop shutdown signal health metric router launch config fleet replica placement scheduler policy
hello world question answer please thank you what why how where when tell me about explain
write story poem code function class return import def self none true false if else for while
0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096
""".split()  # noqa: SIM905 (a word list reads better as text)
_PUNCT = [".", ",", "?", "!", ":", ";", "(", ")", "-", "\n"]


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens of a generated tokenizer, in id order (ids 0, 1, 2, ...)."""

    bos: str
    eos: str
    extra: tuple[str, ...] = ()

    def all(self) -> list[str]:
        return [self.bos, self.eos, *self.extra]


def generate_corpus(seed: int, num_lines: int = 6000) -> list[str]:
    """Return `num_lines` pseudo-sentences drawn from a fixed word list with `seed`."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.append(rng.choice(_PUNCT))
        # Glue in random alphanumeric fragments so the trainer keeps finding new pairs to merge
        # until it reaches the requested vocabulary size.
        fragment = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(6))
        words.insert(rng.randrange(len(words)), fragment)
        lines.append(" ".join(words))
    return lines


def build_tokenizer(vocab_size: int, special: SpecialTokens, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=special.all(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(seed), trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(
            f"tokenizer training reached {got} tokens, not the {vocab_size} asked for; "
            "the generated corpus is too small for this vocabulary size"
        )
    return tokenizer

"""A small ShareGPT-format dataset, generated: what `sglang.bench_serving` reads offline.

    python -m fineslab.bench.sharegpt_mini [--out fineslab/bench/data/sharegpt-mini.json]

SGLang's `sharegpt` dataset (its default) and its `random` dataset (which takes its prompts'
tokens from ShareGPT text) download ShareGPT_V3 (about 650 MB) from the Hugging Face hub
unless `--dataset-path` names a JSON file. `fineslab.bench.bench_serving` passes the file this
module writes, shipped as `DATASET_FILE`: `NUM_CONVERSATIONS` conversations of one human turn
and one gpt turn, each turn English words drawn from `WORDS` by a seeded RNG, in sentences of
6-14 words; turn lengths log-normal (median `PROMPT_MEDIAN_WORDS` / `REPLY_MEDIAN_WORDS` words,
at most `MAX_WORDS`), which keeps `--dataset-name sharegpt` inside the generated models' 4096
token context. The text is not language: bench_serving uses only its tokens and lengths.

Not derived from fineslab/workload/data/: its ShareGPT file holds token counts only, of whole
multi-turn conversations (prompt median 1,730 Llama-2 tokens), no text.
Deterministic: the same seed writes the same bytes; tests/serving/test_bench_serving.py checks
the shipped file against `render()`. Cost: about 0.1 s and 150 kB.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

DATASET_FILE = Path(__file__).resolve().parent / "data" / "sharegpt-mini.json"
NUM_CONVERSATIONS = 256
SEED = 20240623
PROMPT_MEDIAN_WORDS = 24
REPLY_MEDIAN_WORDS = 40
LENGTH_SIGMA = 0.8
MIN_WORDS = 4
MAX_WORDS = 200

_WORD_LIST = """
the a of to and in is that for it on with as was at by this be from or have are an not
but they which you one we all there their has been more if will would about when so can
what some other than time its only new two may these first any could after most also
made over did many before must through back years where much your way well down should
because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while
last might us great old year off come since against go came right used take three model
token cache memory slab arena page block request queue batch prompt reply server router
runtime device kernel layer weight precision scheduler latency budget deadline stream
"""
WORDS = tuple(_WORD_LIST.split())


def _turn(rng: random.Random, median_words: int) -> str:
    """A turn of log-normally many words, in sentences."""
    num_words = round(median_words * math.exp(rng.gauss(0.0, LENGTH_SIGMA)))
    num_words = min(MAX_WORDS, max(MIN_WORDS, num_words))
    sentences: list[str] = []
    while num_words > 0:
        length = min(num_words, rng.randint(6, 14))
        words = [rng.choice(WORDS) for _ in range(length)]
        sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
        num_words -= length
    return " ".join(sentences)


def generate(num_conversations: int = NUM_CONVERSATIONS, seed: int = SEED
             ) -> list[dict[str, object]]:
    """The conversations, as ShareGPT writes them (`id`, `conversations` [{from, value}])."""
    rng = random.Random(seed)
    return [{"id": f"fineslab-mini-{i:04d}", "conversations": [
        {"from": "human", "value": _turn(rng, PROMPT_MEDIAN_WORDS)},
        {"from": "gpt", "value": _turn(rng, REPLY_MEDIAN_WORDS)},
    ]} for i in range(num_conversations)]


def render(conversations: list[dict[str, object]]) -> str:
    """One JSON array, a conversation a line (readable diffs)."""
    lines = ",\n".join(json.dumps(c, sort_keys=True) for c in conversations)
    return f"[\n{lines}\n]\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.sharegpt_mini",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATASET_FILE)
    parser.add_argument("--conversations", type=int, default=NUM_CONVERSATIONS)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(generate(args.conversations, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

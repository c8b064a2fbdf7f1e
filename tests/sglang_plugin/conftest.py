"""Fixtures of the SGLang plugin tests: stand-alone reference outputs, cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugin_test_support import engine_batches


class StockOutputs:
    """Greedy outputs of SGLang's own pool for (model, page size, dtype, prompts, new tokens),
    cached for the session: the identity and co-location tests compare against the same runs.
    `prefetch` computes several batches of one model in one engine."""

    def __init__(self, model_cache: Path) -> None:
        self.model_cache = model_cache
        self.cache: dict[tuple[object, ...], list[list[int]]] = {}

    def __call__(self, model: str, page_size: int, dtype: str,
                 input_ids: tuple[tuple[int, ...], ...], max_new_tokens: int) -> list[list[int]]:
        self.prefetch(model, page_size, dtype, [(input_ids, max_new_tokens)])
        return self.cache[(model, page_size, dtype, input_ids, max_new_tokens)]

    def prefetch(self, model: str, page_size: int, dtype: str,
                 jobs: list[tuple[tuple[tuple[int, ...], ...], int]]) -> None:
        missing = [(ids, n) for ids, n in jobs
                   if (model, page_size, dtype, ids, n) not in self.cache]
        if not missing:
            return
        outputs = engine_batches(self.model_cache / model,
                                 [([list(p) for p in ids], n) for ids, n in missing],
                                 page_size=page_size, dtype=dtype)
        for (ids, n), out in zip(missing, outputs, strict=True):
            self.cache[(model, page_size, dtype, ids, n)] = out


@pytest.fixture(scope="session")
def stock_outputs(model_cache: Path) -> StockOutputs:
    return StockOutputs(model_cache)

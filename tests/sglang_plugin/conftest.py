"""Fixtures of the SGLang plugin tests: stand-alone reference outputs, cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugin_test_support import Reference, engine_outputs


@pytest.fixture(scope="session")
def stock_outputs(model_cache: Path) -> Reference:
    """Greedy outputs of SGLang's own pool for (model, page size, dtype, prompts, new tokens).

    Cached for the session: the identity and co-location tests compare against the same runs.
    """
    cache: dict[tuple[object, ...], list[list[int]]] = {}

    def get(model: str, page_size: int, dtype: str, input_ids: tuple[tuple[int, ...], ...],
            max_new_tokens: int) -> list[list[int]]:
        key = (model, page_size, dtype, input_ids, max_new_tokens)
        if key not in cache:
            cache[key] = engine_outputs(model_cache / model, [list(p) for p in input_ids],
                                        page_size=page_size, dtype=dtype,
                                        max_new_tokens=max_new_tokens)
        return cache[key]

    return get

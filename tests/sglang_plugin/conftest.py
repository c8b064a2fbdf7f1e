"""Fixtures of the SGLang plugin tests: stand-alone reference outputs, cached on disk.

Stock SGLang's greedy outputs depend only on SGLang's version, the model's files, the page
size, the dtype, the prompts and the number of new tokens, never on fineslab's code: each is
computed once (on a server per model and settings, forked warm from the zygote; the last two
kept for the session's later computations) and kept in
`~/.cache/fineslab/stock-outputs/` under a key of exactly those (`FINESLAB_STOCK_CACHE`
names another folder; an empty value keeps them in memory only).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_test_support import STOCK_CACHE_VAR, StockOutputs, StockServers


@pytest.fixture(scope="session")
def stock_outputs(model_cache: Path) -> Iterator[StockOutputs]:
    raw = os.environ.get(STOCK_CACHE_VAR)
    default = Path.home() / ".cache" / "fineslab" / "stock-outputs"
    folder = default if raw is None else (Path(raw) if raw else None)
    servers = StockServers()
    try:
        yield StockOutputs(model_cache, folder, servers)
    finally:
        servers.close()

"""The mixed-precision fleet of test_precision_fleet.py: one arena, five runtimes (bf16, fp8,
awq, kv4 and qoq).

Started once for that module through the launcher (`fineslab.quant.serving.run_fleet` ->
`fineslab.launch.Fleet`; about 2-3 minutes on the 2-core CI machine: the SGLang servers start
in parallel), stopped when the module ends. Not kept for the session: an in-process
`sglang.Engine`'s shutdown kills every child process of the test process, so each later test
that ran an engine killed these runtimes, and the fleet's supervisor restarted them, over
and over, for the rest of the suite (seen in a CI rehearsal: 11 restarts each in 40 minutes,
load average 10). The model is SmolLM2-135M-Instruct when set-up installed it, else the
generated `llama-tiny`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fineslab.bench.precision_fleet import RunningFleet, run_fleet
from fineslab.models import smollm2
from fineslab.precisions import FLEET_PRECISIONS
from fineslab.quant.serving import prepare_runtime

PAGE_SIZE_TOKENS = 16
ARENA_BYTES = 48 << 20
#: Four servers share two cores: one compute thread each avoids oversubscription.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def source_model(cache: Path) -> Path:
    """SmolLM2-135M if installed (FINESLAB_PRECISIONS_MODEL=llama-tiny forces the tiny one)."""
    found = smollm2.find(Path(os.path.expanduser("~/.cache/fineslab/models")))
    if found is not None and os.environ.get("FINESLAB_PRECISIONS_MODEL") != "llama-tiny":
        return Path(found)
    return cache / "llama-tiny"


@pytest.fixture(scope="module")
def fleet(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    work = tmp_path_factory.mktemp("precisions")
    src = source_model(model_cache)
    runtimes = [prepare_runtime(p, src, work) for p in FLEET_PRECISIONS]
    with run_fleet(runtimes, work, f"prec{os.getpid()}", arena_bytes=ARENA_BYTES,
                   page_size_tokens=PAGE_SIZE_TOKENS, extra_env=ONE_THREAD,
                   extra_args=("--log-level", "info"), max_running_requests=8) as running:
        yield running

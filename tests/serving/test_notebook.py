"""The example notebooks run from top to bottom (each launches and stops what it needs; the demo
notebook runs against the demo fleet of test_demo_fleet.py instead)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fleet_support import execute_notebook

pytestmark = pytest.mark.slow


def _execute(name: str, model_cache: Path) -> str:
    """Run examples/`name` top to bottom; the text of all its outputs."""
    return execute_notebook(name, {"FINESLAB_MODEL_CACHE": str(model_cache)})


def _assert_folder_removed(outputs: str, prefix: str = "fineslab-notebook-") -> None:
    """The notebook removed its /tmp/fineslab-notebook-* (or `prefix`) folder (#39 finding 6:
    each run left one)."""
    removed = re.search(rf"removed (\S*{prefix}\S+)", outputs)
    assert removed and not Path(removed.group(1)).exists(), outputs[-1000:]


def test_cpu_elastic_notebook_serves_five_models_in_room_for_three(
        model_cache: Path) -> None:
    """Issue #16's fleet test and notebook in one: five tiny models, weight room for three awake,
    served round-robin by the `openai` client; every request answered, wakes evict LRU models,
    idle models fall asleep, `ctl limit` round-trips, and nothing is left after the stop."""
    outputs = _execute("cpu-elastic.ipynb", model_cache)
    assert outputs.count("weight slab(s) back to the arena") == 2, \
        f"two of the five start asleep: {outputs[:3000]}"
    assert "answered 15 of 15 requests" in outputs, outputs[-4000:]
    evictions = int(outputs.split("evictions in all: ")[1].split()[0])
    assert evictions >= 2, f"round-robin over 5 models in room for 3 must evict: {outputs[-2000:]}"
    assert "all asleep:" in outputs and "KV limit 4.00 MiB per runtime" in outputs, outputs[-4000:]
    assert "shared memory left: [] host copies left: []" in outputs, outputs[-2000:]
    _assert_folder_removed(outputs)


def test_cpu_mixed_notebook_serves_four_precisions_in_one_arena(
        model_cache: Path) -> None:
    """examples/cpu-mixed.ipynb, the mixed fleet as the README starts it (`python -m
    fineslab.launch --config examples/cpu-mixed.yaml`, one fleet for the notebook and this test):
    the bf16, fp8, awq and qoq runtimes all come up and answer completions and chat with the
    requested tokens through the router; the slab table gives each its KV bytes a token (qoq's
    KV4 < fp8 < bf16), its own block size as the plan gives it (FP8's page is twice BF16's, so
    FP8, BF16 and AWQ blocks are one size and share a key pool; KV4 keeps slabs of its own) and
    its arena share; /metrics has each one's used bytes; SIGINT leaves nothing behind."""
    outputs = _execute("cpu-mixed.ipynb", model_cache)
    assert re.search(r"\[4/4\] runtime .* healthy", outputs), outputs[:3000]
    assert "answers from 4 of 4 models" in outputs, outputs[-4000:]
    line = outputs.split("KV bytes per token: ")[1].splitlines()[0]
    per_token = json.loads(line)
    assert per_token["llama-qoq"] < per_token["llama-fp8"] < per_token["llama-bf16"], per_token
    assert 2 * per_token["llama-fp8"] == per_token["llama-bf16"] == per_token["llama-awq"], (
        f"FP8 KV is half of bf16's, AWQ's fp16 KV as bf16's: {per_token}")
    used = json.loads(outputs.split("KV bytes used: ")[1].splitlines()[0])
    held = json.loads(outputs.split("slabs held: ")[1].splitlines()[0])
    assert sorted(used) == sorted(held) == sorted(per_token), (used, held)
    assert all(used[m] > 0 and held[m] >= 1 for m in used), (
        f"every model keeps its KV in arena slabs: {used} {held}")
    keys = json.loads(outputs.split("block bytes: ")[1].splitlines()[0])
    planned = json.loads(outputs.split("block bytes as planned: ")[1].splitlines()[0])
    assert keys == planned, f"each runtime's slabs are keyed by its planned block: {keys}"
    assert keys["llama-fp8"] == keys["llama-bf16"] == keys["llama-awq"] > keys["llama-qoq"], keys
    pooled = json.loads(outputs.split("in a key pool: ")[1].splitlines()[0])
    assert pooled == {"llama-bf16": True, "llama-fp8": True, "llama-awq": True,
                      "llama-qoq": False}, pooled
    assert f"used bytes on /metrics for: {sorted(per_token)}" in outputs, outputs[-3000:]
    assert "launcher exit code 0" in outputs, outputs[-2000:]
    assert "processes left: [] shared memory left: []" in outputs, outputs[-2000:]
    _assert_folder_removed(outputs)


def test_custom_sglang_notebook_installs_the_pool_without_launcher_or_entry_point(
        model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/custom-sglang.ipynb: a user's own SGLang launch (examples/custom_launch.py)
    calls `install(ArenaJoin(...))` in the scheduler with FINESLAB_ARENA/RUNTIME_ID unset, the
    runtime answers, its KV is in the arena's slab table under the scheduler's pid, and the
    arena is unlinked at the end."""
    monkeypatch.delenv("FINESLAB_ARENA", raising=False)
    monkeypatch.delenv("FINESLAB_RUNTIME_ID", raising=False)
    outputs = _execute("custom-sglang.ipynb", model_cache)
    assert re.search(r"scheduler \d+: FINESLAB_ARENA and FINESLAB_RUNTIME_ID unset, "
                     r"install\(\) joined the arena", outputs), outputs[:3000]
    assert re.search(r"answered: '.+' \(\d+ prompt tokens, 8 generated\)", outputs), outputs
    assert re.search(r"slab table: llama-custom pid (\d+) \(the scheduler\) holds [1-9]\d* "
                     r"slab\(s\) of \d+ B blocks, [1-9]\d* used blocks", outputs), outputs
    assert re.search(r"SGLang's KV capacity (\d+) tokens = the arena's \1", outputs), outputs
    assert "processes left: [] shared memory left: []" in outputs, outputs[-2000:]
    _assert_folder_removed(outputs, "fineslab-custom-")

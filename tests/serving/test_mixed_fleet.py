"""End to end: the mixed-precision fleet of examples/cpu-mixed.yaml, launched the way the README
says (`python -m fineslab.launch --config examples/cpu-mixed.yaml`): bf16, fp8 (W8A8KV8), awq
(W4A16) and qoq (W4A8KV4) runtimes of llama-tiny in one slab arena, real SGLang, real HTTP
through the router. One fleet for the module (start: about 2-4 min on the loaded 2-core
machine); the last test shuts it down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fleet_support import REPO, LaunchedFleet, group_alive, launched, shm_files

from fineslab.launch.config import load_fleet_config
from fineslab.launch.plan import make_plan

pytestmark = pytest.mark.slow

#: model -> (precision, KV dtype), as examples/cpu-mixed.yaml declares them.
MODELS = {"llama-bf16": ("bf16", "bf16"), "llama-fp8": ("fp8", "fp8_e4m3"),
          "llama-awq": ("awq", "fp16"), "llama-qoq": ("qoq", "int4")}
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[LaunchedFleet]:
    folder = tmp_path_factory.mktemp("mixed-fleet")
    with launched("cpu-mixed.yaml", folder, model_cache, f"mixed-{os.getpid()}",
                  signal.SIGINT) as (running, start_s):
        print(f"cpu-mixed fleet ready after {start_s:.0f} s")
        yield running


def test_all_four_runtimes_come_up_healthy(fleet: LaunchedFleet) -> None:
    out = fleet.output.read_text()
    assert re.search(r"\[4/4\] runtime .* healthy", out), out[-3000:]
    health = fleet.health().json()
    assert health["status"] == "ok", health
    assert sorted(health["models"]) == sorted(MODELS)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_model_answers_completions_and_chat_with_the_requested_tokens(
        fleet: LaunchedFleet, model: str) -> None:
    client = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key="unused", timeout=300)
    reply = client.completions.create(
        model=model, prompt="The slab arena", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert reply.model == model and reply.choices[0].text, f"{model}: empty completion"
    assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS, reply.usage
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content, f"{model}: empty chat answer"
    assert chat.usage is not None and chat.usage.completion_tokens == MAX_TOKENS, chat.usage


def _slab_table(fleet_id: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.slabs", "--fleet", fleet_id, "--device", "cpu0",
         "--json"], capture_output=True, text=True, timeout=60, check=True)
    table: dict[str, object] = json.loads(result.stdout)
    return table


def test_each_model_holds_arena_slabs_in_its_own_block_format(fleet: LaunchedFleet,
                                                              model_cache: Path) -> None:
    """After a prompt of several pages to each model (its radix cache keeps the whole pages),
    each runtime holds arena blocks keyed by its own block stride: the plan gives FP8 (half
    BF16's bytes a token) twice BF16's page, so FP8, BF16 and AWQ (fp16 KV) blocks are one size
    and those three share one key pool; KV4's block is smaller and keeps slabs of its own."""
    client = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key="unused", timeout=300)
    for model in MODELS:
        reply = client.completions.create(model=model, prompt="The slab arena " * 40,
                                          max_tokens=1, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens >= 64, reply.usage
    plan = make_plan(load_fleet_config(REPO / "examples" / "cpu-mixed.yaml"),
                     str(model_cache))
    formats = {r.model.name: plan.arenas[0].slab_plan.format_of(r.runtime_id)
               for r in plan.runtimes}
    owners = {o["runtime_id"]: o for o in _slab_table(fleet.fleet_id)["owners"]}  # type: ignore
    for model in MODELS:
        owner = owners[f"{model}-r0"]
        assert owner["alive"] and owner["slabs"] >= 1 and owner["used_blocks"] >= 1, (
            f"{model} holds no arena block: {owner}")
        assert owner["key"] == formats[model].block_stride_bytes, (
            f"{model}: slabs keyed {owner['key']} B, its format's block is "
            f"{formats[model].block_stride_bytes} B")
    keys = {m: owners[f"{m}-r0"]["key"] for m in MODELS}
    assert keys["llama-fp8"] == keys["llama-bf16"] == keys["llama-awq"], keys
    assert formats["llama-fp8"].tokens_per_block == 2 * formats["llama-bf16"].tokens_per_block
    assert keys["llama-qoq"] < keys["llama-fp8"], keys
    pooled = {m: owners[f"{m}-r0"]["pooled"] for m in MODELS}
    assert pooled == {"llama-bf16": True, "llama-awq": True, "llama-fp8": True,
                      "llama-qoq": False}, pooled
    metrics = fleet.metrics()
    for model in MODELS:
        match = re.search(
            rf'fineslab_slab_owner_used_bytes{{device="cpu",owner="{model}-r0"}} (\S+)', metrics)
        assert match, f"/metrics has no used bytes for {model}"


def test_sigint_stops_everything_and_leaves_no_process_or_shared_memory(
        fleet: LaunchedFleet) -> None:
    pids = list(fleet.runtime_pids().values())
    assert len(pids) == len(MODELS)
    os.killpg(fleet.proc.pid, signal.SIGINT)
    assert fleet.proc.wait(180) == 0, fleet.output.read_text()[-3000:]
    time.sleep(0.5)
    alive = [pid for pid in [*pids, fleet.proc.pid] if group_alive(pid)]
    assert not alive, f"process groups still alive: {alive}"
    assert not shm_files(fleet.fleet_id), shm_files(fleet.fleet_id)
    assert "fleet stopped" in fleet.output.read_text()

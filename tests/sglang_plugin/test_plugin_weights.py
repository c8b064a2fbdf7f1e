"""Weights in the arena (issue #16): a runtime with FINESLAB_WEIGHTS_IN_ARENA=1 moves its loaded
weights into whole slabs of its arena; the slab table shows them as an owner of their own
(`<runtime>:w`) beside its KV, and greedy output equals SGLang's own (stock pool, stock
weights). Real in-process SGLang engine on CPU, qwen2-tiny (qkv bias), BF16; llama-tiny's
weights go through the same path in test_plugin_sleep.py and the wake benchmark.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from plugin_test_support import Reference, arena_for, joined, kv_shape, prompts, settled_integrity

from fineslab.runtime import cpu_engine_kwargs, shutdown_engine, start_engine
from fineslab.slabs import snapshot

PROMPTS = tuple(tuple(p) for p in prompts(3, 24, seed=11))
NEW_TOKENS = 12
SLAB = 1 << 20


@pytest.mark.slow
def test_weights_move_into_the_arena_and_output_equals_stock(
        model_cache: Path, stock_outputs: Reference) -> None:

    model = "qwen2-tiny"  # its qkv biases: more kinds of tensor than llama-tiny has
    arena = arena_for([kv_shape(model, "bfloat16", "m")], 16, SLAB, num_slabs=16)
    join = dataclasses.replace(arena.join("m"), weights_in_arena=True)
    try:
        with joined(join):
            engine = start_engine(**cpu_engine_kwargs({
                "model_path": str(model_cache / model), "dtype": "bfloat16", "page_size": 16,
                "log_level": "error"}))
        try:
            owners = {o.runtime_id: o for o in snapshot(arena.arena.table).owners}
            weights = owners["m:w"]
            assert weights.alive and weights.key == SLAB and weights.num_slabs >= 2, weights
            assert weights.used_blocks == weights.num_slabs, "weight slabs are held whole"
            out = engine.generate(input_ids=[list(p) for p in PROMPTS], sampling_params={
                "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
            settled_integrity(arena.arena.table)
        finally:
            shutdown_engine(engine)
        # The runtime is gone: its weight and KV slabs come back with its dead owners.
        assert set(arena.arena.table.reclaim_dead_owners()) <= {"m", "m:w"}
        assert arena.used_bytes() == {}, "a stopped runtime holds no arena memory"
    finally:
        arena.close()
    stock = stock_outputs(model, 16, "bfloat16", PROMPTS, NEW_TOKENS)
    assert [o["output_ids"] for o in out] == stock, f"{model}: output differs from stock"


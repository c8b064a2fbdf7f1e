"""Identity: greedy output with the slab pool equals output with SGLang's own pool.

Real SGLang servers on CPU (forked warm from the zygote; the plugin's told its arena in its
environment, as a fleet's runtime is), torch_native attention:
Llama (page sizes 1 and 20) and Qwen2 (16) (a key-sharing plan's kind of page: not a power of
two, so SGLang allocates its slots on the torch path), BF16 KV. FP8 KV cannot run end to end
on CPU (SGLang 0.5.23 serves CPU FP8 KV only through the intel_amx backend, which needs the
CUDA-less sgl_kernel build), so FP8 is checked here at the pool level, through SGLang's own
write and read paths, and end to end on a GPU (test_plugin_gpu.py, marked gpu).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from plugin_test_support import Reference, arena_for, kv_shape, plugin_outputs, prompts
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from fineslab.sglang_plugin.pool import SlabKVPool
from fineslab.slabs import KVDtype, KVShape, check_integrity
from fineslab.slabs.sizing import fit_format
from fineslab.slabs.views import layer_views

PROMPTS = tuple(tuple(p) for p in prompts(3, 24, seed=7))
NEW_TOKENS = 16


# Each page size once and each model once, not the whole grid: every case costs two server
# starts (plugin and stock), and the page size and the model touch different code (the slot
# path for page 1 and 20, the geometry and qkv bias for the model).
@pytest.mark.slow
@pytest.mark.parametrize(("model", "page_size"),
                         [("llama-tiny", 1), ("llama-tiny", 20), ("qwen2-tiny", 16)])
def test_greedy_output_equals_stock_pool(model_cache: Path, stock_outputs: Reference,
                                         model: str, page_size: int) -> None:
    slab_bytes = 5 << 18 if page_size == 20 else 1 << 20  # 1.25 MiB: a multiple of 20 tokens
    arena = arena_for([kv_shape(model, "bfloat16", "m")], page_size, slab_bytes, num_slabs=4)
    try:
        plugin = plugin_outputs(model_cache / model, [list(p) for p in PROMPTS],
                                page_size=page_size, join=arena.join("m"),
                                max_new_tokens=NEW_TOKENS)
        # The server is gone; its blocks must be back in the free space (dead owner reclaimed).
        assert arena.arena.table.reclaim_dead_owners() in ([], ["m"])
        assert arena.used_bytes() == {}, "a stopped runtime must hold no arena memory"
    finally:
        arena.close()
    stock = stock_outputs(model, page_size, "bfloat16", PROMPTS, NEW_TOKENS)
    assert plugin == stock, f"{model} page {page_size}: slab pool output differs from stock"


@pytest.mark.slow
def test_greedy_output_equals_stock_pool_in_a_key_pool(model_cache: Path,
                                                       stock_outputs: Reference) -> None:
    """The runtime shares its key's slabs with a neighbour of the same block stride (here the
    test process, stamping its blocks): it fills the holes the neighbour left in a shared
    slab, its output equals stock, and the neighbour's bytes are untouched.

        slab 0: [n n n ... n]  the neighbour holds it all (the padding slab: never KV)
        slab 1: [n . n . ...]  holes at every odd block, which the runtime fills
    """
    model, page_size = "llama-tiny", 16
    shape = kv_shape(model, "bfloat16", "m")
    arena = arena_for([shape], page_size, 1 << 20, num_slabs=4)
    fmt = fit_format(shape, 1 << 20, [page_size])
    assert fmt is not None
    neighbour = arena.arena.client("neighbour", fmt, pooled=True)
    try:
        bps = fmt.blocks_per_slab(1 << 20)
        padding, held = neighbour.alloc(bps), neighbour.alloc(bps)  # slabs 0 and 1
        assert max(padding) < bps <= min(held), "slab 0 first, then slab 1"
        neighbour.free(held[1::2])  # holes at every odd block of slab 1
        neighbour.release_cache()  # idle from here on, as its plugin's idle check would leave it
        kept = held[0::2]
        data = arena.arena.tensor().view(-1, fmt.block_stride_bytes)  # type: ignore[attr-defined]
        for block in kept:
            data[block].fill_(block % 251 + 1)
        join = dataclasses.replace(arena.join("m"), key_pool=True)
        plugin = plugin_outputs(model_cache / model, [list(p) for p in PROMPTS],
                                page_size=page_size, join=join, max_new_tokens=NEW_TOKENS)
        for block in kept:
            assert bool((data[block] == block % 251 + 1).all()), f"block {block} overwritten"
        holes = [b for b in held[1::2]]
        assert any(bool(data[b].any()) for b in holes), \
            "the runtime wrote KV into the holes of the neighbour's slab (it used the pool)"
        assert arena.arena.table.reclaim_dead_owners() in ([], ["m"])
        check_integrity(arena.arena.table)
        assert arena.used_bytes() == {"neighbour": (len(kept) + bps) * fmt.block_stride_bytes}, \
            "the stopped runtime's blocks went back to the pool"
    finally:
        neighbour.close()
        arena.close()
    stock = stock_outputs(model, page_size, "bfloat16", PROMPTS, NEW_TOKENS)
    assert plugin == stock, "key-pool output differs from stock"


def _pool_pair(dtype: torch.dtype, kv: KVDtype, page_size: int
               ) -> tuple[MHATokenToKVPool, MHATokenToKVPool]:
    """A stock pool and a slab pool of the same geometry (2 layers, 2 heads, head_dim 64)."""
    shape = KVShape("p", 2, 2, 64, kv)
    fmt = fit_format(shape, 1 << 18, [page_size])
    assert fmt is not None
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    size = arena.numel() // fmt.token_stride_bytes - page_size
    common = dict(page_size=page_size, dtype=dtype, head_num=2, head_dim=64, layer_num=2,
                  device="cpu", enable_memory_saver=False)
    stock = MHATokenToKVPool(size, **common)
    slab = SlabKVPool.over(layer_views(arena, fmt))(size, **common)
    return stock, slab


@pytest.mark.parametrize("kv", [KVDtype.FP8_E4M3, KVDtype.BF16])
def test_pool_writes_and_reads_like_stock(kv: KVDtype) -> None:
    dtype = torch.float8_e4m3fn if kv is KVDtype.FP8_E4M3 else torch.bfloat16
    stock, slab = _pool_pair(dtype, kv, page_size=16)
    gen = torch.Generator().manual_seed(0)
    loc = torch.randperm(stock.size, generator=gen)[:40] + 16
    for layer_id in range(2):
        layer = SimpleNamespace(layer_id=layer_id)
        k = torch.randn(40, 2, 64, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(40, 2, 64, generator=gen, dtype=torch.bfloat16)
        for pool in (stock, slab):
            pool.set_kv_buffer(layer, loc, k.clone(), v.clone())
    for layer_id in range(2):
        for get in ("get_key_buffer", "get_value_buffer"):
            want = getattr(stock, get)(layer_id)[loc]
            got = getattr(slab, get)(layer_id)[loc]
            assert got.dtype == want.dtype == dtype, "reads must come back in the KV dtype"
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                f"{kv.name} layer {layer_id} {get}: slab pool bytes differ from stock")
    assert slab.k_buffer[0].data_ptr() != slab.k_buffer[1].data_ptr(), "layers must not alias"

"""LentRadixCache in-process: SGLang's radix tree over a real SlabAllocator and arena, no server.

The server tests (`test_plugin_prefix_tier.py`) show the tier end to end; these pin the tree's
side: an evicted node's pages come back byte for byte through match_prefix / init_load_back,
and a failing tier never fails SGLang's eviction (every victim's pages are still freed).
Requests are stand-ins carrying the `rid` the overrides read.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from plugin_test_support import arena_for, kv_shape, slab_allocator

from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.lent import LentPages, set_lend_cap

PAGE = 4
FMT = BlockFormat.unpadded(kv_shape("llama-tiny", "bfloat16", "m"), PAGE)


@pytest.fixture
def tree():  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from fineslab.sglang_plugin.prefix_tier import LentRadixCache

    arena = arena_for([FMT.shape], PAGE, FMT.block_stride_bytes * 8, 12)
    source = arena.arena.client("m", FMT)
    allocator = slab_allocator(arena, source, FMT, PAGE, 256)
    pages = arena.arena.tensor().view(-1, FMT.block_stride_bytes)  # type: ignore[attr-defined]
    set_lend_cap(arena.arena.table, "m", 4)
    lent = LentPages(arena.arena.table, source.slot, pages, source.blocks_per_slab)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=PAGE)
    try:
        yield LentRadixCache(params, lent), allocator, pages
    finally:
        source.close()
        arena.close()


def _insert(tree, allocator, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = allocator.alloc(len(tokens))
    tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    return slots


def test_an_evicted_node_comes_back_byte_for_byte_as_a_host_hit(tree) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator, pages = tree
    tokens = list(range(100, 116))  # 4 pages
    slots = _insert(cache, allocator, tokens)
    page_ids = (slots[::PAGE] // PAGE).tolist()
    pages[page_ids] = torch.arange(1, 5, dtype=torch.uint8)[:, None]  # distinct KV per page
    written = pages[page_ids].clone()
    assert cache.evict(EvictParams(num_tokens=16)).num_tokens_evicted == 16
    assert len(cache.lent.index) == 4, "its four pages went to the lent tier"
    req = SimpleNamespace(rid="r1")
    key = RadixKey(array("q", [*tokens, 7, 8]))
    match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
    assert (match.device_prefix_len, match.host_hit_length) == (0, 16)
    loaded, node = cache.init_load_back(InitLoadBackParams(
        best_match_node=match.best_match_node, host_hit_length=16, req=req))
    assert loaded == 16 and node is not cache.root_node
    assert torch.equal(pages[(node.value[::PAGE] // PAGE).tolist()], written)
    assert cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len == 16, \
        "the loaded pages are in the tree now"


def test_a_failing_tier_never_fails_eviction(tree, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, allocator, _ = tree
    _insert(cache, allocator, list(range(200, 208)))
    used = allocator.used_tokens()

    def broken(*args: object) -> int:
        raise RuntimeError("lent store broke")

    monkeypatch.setattr(cache.lent, "store", broken)
    assert cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8
    assert allocator.used_tokens() == used - 8, "every victim's pages were freed all the same"
    assert cache.evictable_size() == 0

"""The cache squeeze in-process: two runtimes' SlabAllocators in one arena, each under SGLang's own
radix cache, no server. A runtime short of free slabs posts; the neighbour that sees the post at
the start of its next turn evicts its least recently used prefixes until the arena has the
slabs, and no more. `test_cache_squeeze_fleet.py` shows it end to end with SGLang servers.

Arena: 8 slabs of 4 pages (page 16), slab 0 the padding slab. The neighbour "n" caches three
prefixes of two slabs each (slabs 1-6, and slab 0 parked by its first draw); slab 7 is free.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from plugin_test_support import ScratchArena, slab_allocator

from fineslab.sglang_plugin import cache_squeeze
from fineslab.sglang_plugin.allocator import SlabAllocator
from fineslab.slabs import KVDtype, KVShape, RuntimeSlabs
from fineslab.slabs.sizing import fit_format

PAGE = 16
SHAPE = KVShape("m", 2, 2, 64, KVDtype.BF16)  # 1,024 B a token, 16 KiB a block
SLAB_BYTES = 64 << 10
NUM_SLABS = 8
BPS = 4
PREFIX = 2 * BPS * PAGE  # two slabs of tokens


@dataclass
class Runtime:
    source: RuntimeSlabs
    allocator: SlabAllocator
    cache: Any  # SGLang's RadixCache


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Runtime, Runtime, ScratchArena]]:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from fineslab.sglang_plugin import allocator as module

    monkeypatch.setattr(module, "STARVED_WAIT_S", 0.05)  # nobody gives back but by the squeeze
    monkeypatch.setattr(cache_squeeze, "POST_GAP_S", 0.0)
    arena = ScratchArena.create(SLAB_BYTES, NUM_SLABS, BPS)
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None and fmt.blocks_per_slab(SLAB_BYTES) == BPS
    runtimes = []
    for rid in ("n", "m"):
        source = arena.arena.client(rid, fmt)
        allocator = slab_allocator(arena, source, fmt, PAGE, (NUM_SLABS - 1) * BPS * PAGE)
        cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                           token_to_kv_pool_allocator=allocator, page_size=PAGE))
        runtimes.append(Runtime(source, allocator, cache))
    try:
        yield runtimes[0], runtimes[1], arena
    finally:
        for runtime in runtimes:
            runtime.source.close()
        arena.close()


def _cache_prefix(runtime: Runtime, first_token: int) -> None:
    """A finished request's prefix, left in the runtime's radix cache (unreferenced)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = runtime.allocator.alloc(PREFIX)
    assert slots is not None
    key = RadixKey(array("q", range(first_token, first_token + PREFIX)))
    runtime.cache.insert(InsertParams(key=key, value=slots))
    time.sleep(0.01)  # distinct access times: the eviction order is least recently used


def _cached(runtime: Runtime, first_token: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", range(first_token, first_token + PREFIX)))
    return int(runtime.cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len)


def _fill(n: Runtime, arena: ScratchArena) -> None:
    for first in (1000, 2000, 3000):
        _cache_prefix(n, first)
    assert arena.arena.table.free_slab_count() == 1, "slab 7 alone is free"


def _short(runtime: Runtime, tokens: int = PREFIX) -> bool:
    """A decode step's capacity check as SGLang makes it: True when it fits."""
    return bool(runtime.allocator.check_decode_capacity(num_tokens=tokens,
                                                        tree_cache=runtime.cache))


def test_a_short_runtime_gets_the_slabs_an_idle_neighbours_cache_held_and_no_more(
        pair: tuple[Runtime, Runtime, ScratchArena]) -> None:
    n, m, arena = pair
    _fill(n, arena)
    assert not _short(m), "two slabs wanted, one free"
    counter, wanted = arena.arena.table.cache_squeeze
    assert (counter, wanted) == (1, 2), "m posted: the arena must have two free slabs"

    evicted = n.allocator.give_cache_back(n.cache)
    assert evicted == PREFIX, "the least recently used prefix (two slabs) covers the want"
    assert _cached(n, 1000) == 0, "the oldest prefix went"
    assert _cached(n, 2000) == PREFIX and _cached(n, 3000) == PREFIX, "the others stay cached"
    assert _short(m), "m's next attempt finds its slabs"
    assert n.allocator.give_cache_back(n.cache) == 0, "one post, one eviction"
    m.allocator.release_reserve()
    assert m.allocator.check_integrity() == [] and n.allocator.check_integrity() == []


def test_no_post_no_eviction(pair: tuple[Runtime, Runtime, ScratchArena]) -> None:
    """The negative control: the same full arena, nobody short, nothing evicted."""
    n, _, arena = pair
    _fill(n, arena)
    assert n.allocator.give_cache_back(n.cache) == 0
    assert all(_cached(n, first) == PREFIX for first in (1000, 2000, 3000))


def test_an_admission_short_of_the_arena_posts(pair: tuple[Runtime, Runtime, ScratchArena]
                                               ) -> None:
    n, m, arena = pair
    _fill(n, arena)
    budget = m.allocator.create_prefill_budget(m.cache)
    fits, _ = budget.check_prefill(extend_input_len=PREFIX, total_tokens=PREFIX,
                                   max_new_tokens=0, input_tokens=PREFIX,
                                   swa_host_hit_length=0, chunk_limit=None)
    assert not fits
    assert arena.arena.table.cache_squeeze[0] == 1, "the refused admission asked"
    assert n.allocator.give_cache_back(n.cache) > 0


def test_a_runtime_does_not_obey_its_own_post(pair: tuple[Runtime, Runtime, ScratchArena]
                                              ) -> None:
    n, _, arena = pair
    _fill(n, arena)
    table = arena.arena.table
    own, other = cache_squeeze.CacheSqueeze(table), cache_squeeze.CacheSqueeze(table)
    assert own.post(5)
    assert own.obey(n.cache, PAGE, BPS) == 0, "its own post: its cache was counted already"
    assert other.obey(n.cache, PAGE, BPS) > 0, "the same cache, another runtime's squeeze"


def test_no_post_when_the_own_cache_covers_the_shortfall_or_the_kv_limit_binds(
        pair: tuple[Runtime, Runtime, ScratchArena]) -> None:
    n, m, arena = pair
    _fill(n, arena)
    table = arena.arena.table
    assert _short(n), "n's own cache covers it: SGLang's eviction frees it"
    assert table.cache_squeeze[0] == 0, "so nobody was asked"
    n.allocator.release_reserve()
    _cache_prefix(n, 4000)  # the arena full again
    assert table.free_slab_count() <= 1
    table.set_kv_limit("m", SLAB_BYTES)
    assert not _short(m), "past m's KV limit"
    assert table.cache_squeeze[0] == 0, "a neighbour's memory would not help: no post"
    table.set_kv_limit("m", None)
    assert not _short(m)
    assert table.cache_squeeze[0] == 1, "the same check without the limit posts"


def test_a_neighbour_evicts_only_what_no_request_references(
        pair: tuple[Runtime, Runtime, ScratchArena]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    n, m, arena = pair
    _fill(n, arena)
    for first in (1000, 2000, 3000):  # every prefix in use by a running request
        key = RadixKey(array("q", range(first, first + PREFIX)))
        n.cache.inc_lock_ref(n.cache.match_prefix(MatchPrefixParams(key=key)).last_device_node)
    assert not _short(m)
    assert arena.arena.table.cache_squeeze[0] == 1
    assert n.allocator.give_cache_back(n.cache) == 0
    assert all(_cached(n, first) == PREFIX for first in (1000, 2000, 3000))


def test_posts_are_spaced_by_the_post_gap(pair: tuple[Runtime, Runtime, ScratchArena],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    n, m, arena = pair
    _fill(n, arena)
    monkeypatch.setattr(cache_squeeze, "POST_GAP_S", 60.0)
    for _ in range(5):  # a starved allocation retries every 10 ms
        assert not _short(m)
    assert arena.arena.table.cache_squeeze[0] == 1


def test_switched_off_a_runtime_neither_posts_nor_obeys(
        pair: tuple[Runtime, Runtime, ScratchArena]) -> None:
    from fineslab.env import CACHE_SQUEEZE_VAR, FineslabEnv

    n, m, arena = pair
    _fill(n, arena)
    assert not FineslabEnv.from_environ({CACHE_SQUEEZE_VAR: "0"}).cache_squeeze
    assert FineslabEnv.from_environ({}).cache_squeeze
    m.allocator._squeeze = None  # what build_allocator gives with FINESLAB_CACHE_SQUEEZE=0
    assert not _short(m)
    assert arena.arena.table.cache_squeeze[0] == 0
    arena.arena.table.squeeze_caches(2)
    n.allocator._squeeze = None
    assert n.allocator.give_cache_back(n.cache) == 0
    assert all(_cached(n, first) == PREFIX for first in (1000, 2000, 3000))


def test_a_model_with_cache_squeeze_false_gets_the_variable_and_the_others_do_not() -> None:
    from pathlib import Path

    import yaml

    from fineslab.env import CACHE_SQUEEZE_VAR, FineslabEnv
    from fineslab.errors import ConfigError
    from fineslab.fleet.config import fleet_from_dict
    from fineslab.fleet.plan import make_plan
    from fineslab.fleet.runtimes import server_spec
    from fineslab.quant.serving import PrecisionRuntime

    repo = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((repo / "examples" / "cpu-demo.yaml").read_text())
    data["models"][0]["cache_squeeze"] = False
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    kept, other = (plan.runtimes_of(data["models"][i]["name"])[0] for i in (0, 1))
    specs = [server_spec(r, PrecisionRuntime(r.model.name, "bf16", Path(r.model_dir),
                                             KVDtype.BF16, ()), "f", True)
             for r in (kept, other)]
    assert specs[0].env[CACHE_SQUEEZE_VAR] == "0"
    assert not FineslabEnv.from_environ(specs[0].env).cache_squeeze
    assert CACHE_SQUEEZE_VAR not in specs[1].env, "on by default"
    data["models"][0]["cache_squeeze"] = "sometimes"
    with pytest.raises(ConfigError, match="cache_squeeze"):
        fleet_from_dict(data, "test.yaml")
    data["models"][0]["cache_squeeze"] = True
    data["models"][0]["env"] = {CACHE_SQUEEZE_VAR: "0"}
    with pytest.raises(ConfigError, match="the launcher sets them"):
        fleet_from_dict(data, "test.yaml")

"""Cache squeeze: a runtime short of free slabs asks every neighbour for its unreferenced prefix
cache, and each neighbour gives it back in its own next scheduler turn.

The problem: SGLang keeps a finished request's KV in its prefix (radix) cache and evicts it only
for its own allocations. In a shared arena a busy neighbour's cache holds slabs that another
runtime's waiting request needs; the launcher's reclaim rounds (`fineslab.fleet.reclaim`)
flush only idle runtimes, once a second at best and at most every 5 s per runtime, from
outside. The live capacity grid's shift workload missed its target on exactly this: the arena
full, the neighbours' caches holding slabs, multi-second stalls (docs/evaluation.md).

The answer, two halves over two words of the slab table's header (`SlabTable.cache_squeeze`):

    post    a reservation that found the arena short of free slabs after counting this
            runtime's own prefix cache (an admission, a decode step's capacity check, a starved
            allocation), within its own capacity and KV limit (so a neighbour holds the
            memory), writes how many free slabs the arena must have for it (those free now plus
            those it lacks) and moves the counter; at most once per POST_GAP_S per runtime
    obey    at the start of each scheduler turn (the admission hook) a runtime that sees the
            counter move evicts its unreferenced prefix cache, least recently used first, one
            slab's worth of its pages at a time, until the arena has the wanted free slabs or
            nothing of its cache is left to evict; its own posts it does not obey

A neighbour's pages lie in slabs of its own, and a slab goes back to the arena only once every
block of it is free, so the eviction counts free slabs, not tokens. Nothing waits: the poster's
request waits as it did (SGLang's queue, the allocator's starved wait), and its next attempt
finds the slabs. An idle runtime's scheduler turns too, once a second with SGLang's idle
sleeper (CPU mode) and at once on a GPU, so the idle case no longer waits for the launcher.

Cost: the check is two loads from shared memory a turn; an eviction costs SGLang's own evict.
What a busy neighbour loses is cached prefixes it would have reused: the least recently used,
and only while another runtime's request waits for the memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fineslab.slabs.table import SlabTable

logger = logging.getLogger(__name__)

#: A runtime posts at most once per POST_GAP_S (s): its starved allocation retries every 10 ms.
POST_GAP_S = 0.05


def evictable_tokens(tree_cache: Any) -> int:
    """The tokens of `tree_cache` that no request references (SGLang's own measure)."""
    if tree_cache is None or not tree_cache.supports_prefix_sharing():
        return 0
    return int(tree_cache.full_evictable_size() if tree_cache.supports_mamba()
               else tree_cache.evictable_size())


class CacheSqueeze:
    """One runtime's side of the squeeze: `post` when short, `obey` each scheduler turn."""

    def __init__(self, table: SlabTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self._clock = clock
        self._seen, _ = table.cache_squeeze
        self._last_post_s = float("-inf")
        self.posts = 0
        self.evicted_tokens = 0

    def post(self, wanted_slabs: int) -> bool:
        """This runtime needs the arena to have `wanted_slabs` free slabs (what it has now and
        what it lacks): ask the neighbours. Returns whether it posted (not within POST_GAP_S
        of its last post)."""
        now_s = self._clock()
        if now_s - self._last_post_s < POST_GAP_S:
            return False
        self._last_post_s = now_s
        self._seen = self.table.squeeze_caches(wanted_slabs)
        self.posts += 1
        return True

    def obey(self, tree_cache: Any, page_size: int, pages_per_slab: int) -> int:
        """If a neighbour posted since the last turn, evict this runtime's unreferenced prefix
        cache until the arena has the free slabs it wanted; returns the tokens evicted."""
        counter, wanted = self.table.cache_squeeze
        if counter == self._seen:
            return 0
        self._seen = counter
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        before = evictable = evictable_tokens(tree_cache)
        free = self.table.free_slab_count()
        chunk = max(1, pages_per_slab) * page_size
        while free < wanted and evictable > 0:
            tree_cache.evict(EvictParams(num_tokens=min(chunk, evictable)))
            left = evictable_tokens(tree_cache)
            if left >= evictable:  # nothing moved: the rest is locked after all
                break
            evictable, free = left, self.table.free_slab_count()
        evicted = before - evictable
        if evicted:
            self.evicted_tokens += evicted
            logger.info("a neighbour's request needs %d free slab(s) in the arena: evicted %d "
                        "token(s) of this runtime's prefix cache; %d slab(s) free now",
                        wanted, evicted, free)
        return evicted

"""LentRadixCache: SGLang's radix cache with a lent tier under it (SwiftCache, issue #20).

Registered as the radix-cache backend `fineslab_lent` (`--radix-cache-backend fineslab_lent`,
SGLang's own `register_radix_cache_backend`); the launcher selects it for a model with
`prefix_lending` (docs/prefix.md). The overrides of `RadixCache` that do the work (`reset` and
`on_release` below only keep its state):

    evict             the victims' pages are copied into lent slabs of the arena (`LentPages`)
                      before their pages are freed, keyed by `page_hashes`; then freed as usual
    match_prefix      past the prefix still in the tree, the run of pages the lent tier holds
                      is reported as `host_hit_length` (page aligned); nothing is copied yet
    init_load_back    when SGLang admits the request: allocate pages, copy them in, and
                      attach them as a node under the matched one; all promised tokens or none
                      (a page taken back by a lender meanwhile turns the whole load into a
                      recompute, never an error)

Glossary
    page hash   h_k = blake2b(h_{k-1} || tokens of page k), h_{-1} from the key's namespace
                (extra_key, cache_salt): a page's hash names its whole prefix, so equal hashes
                mean equal KV (greedy outputs match a recompute, tests/sglang_plugin)
    end hash    the hash of a node's last page (`_fs_end`, memoized on the node); the root's is
                h_{-1} of its namespace, computed per key
    marker      what match_prefix found for a request (its hashes and tokens), consumed by
                init_load_back; at most one per request, dropped on release
    flush       `reset` (SGLang's /flush_cache, which a weight update also runs) drops the lent
                pages with the tree: they are KV of the weights they were computed with

Why a `RadixCache` subclass and not the unified cache's external linker: the linker writes
through (every insert is copied out, SGLANG-ON-CPU.md), where this tier copies only the pages
eviction would drop; and this seam's loads are synchronous, so no fence is needed on CPU. It
costs UnifiedRadixCache's extras (session cache, SWA/Mamba models), which the slab pool refuses
anyway.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from fineslab.slabs.lent import LentPages

logger = logging.getLogger(__name__)

_DIGEST = 16


def namespace_hash(key: RadixKey) -> bytes:
    """h_{-1}: keys of different namespaces never share pages."""
    tag = f"{key.extra_key!r}|{key.cache_salt!r}".encode()
    return hashlib.blake2b(tag, digest_size=_DIGEST).digest()


def page_hashes(start: bytes, tokens: array, page_size: int) -> list[bytes]:
    """The chained hash of every whole page of `tokens`, continuing from `start`."""
    out, h = [], start
    for begin in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(h + tokens[begin: begin + page_size].tobytes(),
                            digest_size=_DIGEST).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class _Marker:
    node: TreeNode
    tokens: RadixKey  # the hit's key, detached from the request's growing fill ids
    hashes: list[bytes]


class LentRadixCache(RadixCache):
    """A `RadixCache` whose evicted pages go to the lent tier `lent` (None: plain behaviour)."""

    lent: LentPages | None = None

    def __init__(self, params: Any, lent: LentPages | None) -> None:
        super().__init__(params)
        self.lent = lent
        self._markers: dict[str, _Marker] = {}

    # -- hashes -----------------------------------------------------------------------------
    def _end_hash(self, node: TreeNode, key: RadixKey) -> bytes:
        """The hash of `node`'s last page (the namespace's h_{-1} at the root)."""
        path: list[TreeNode] = []
        while node is not self.root_node and getattr(node, "_fs_end", None) is None:
            path.append(node)
            node = node.parent
        h = namespace_hash(key) if node is self.root_node else node._fs_end
        for step in reversed(path):
            h = page_hashes(h, step.key.raw_token_ids(), self.page_size)[-1]
            step._fs_end = h
        return h

    # -- evict ------------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or self.lent is None:
            return super().evict(params)
        started = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        victims: list[TreeNode] = []
        evicted = 0
        while evicted < params.num_tokens and heap:
            _, node = heapq.heappop(heap)
            victims.append(node)
            evicted += len(node.value)
            self._delete_leaf(node)
            parent = node.parent
            if not parent.children and parent.lock_ref == 0 and parent is not self.root_node:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
            self.kv_events.record_remove(node)
        try:
            self._lend(victims)  # before any page is freed: nobody else can have them yet
        except Exception:  # the tier is an optimization: never fail SGLang's eviction
            logger.exception("lent tier: storing %d evicted node(s) failed; their pages are "
                             "dropped as without the tier", len(victims))
        for node in victims:
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        self.update_eviction_metrics(evicted, started)
        return EvictResult(num_tokens_evicted=evicted)

    def _lend(self, victims: list[TreeNode]) -> None:
        assert self.lent is not None
        hashes: list[bytes] = []
        pages: list[int] = []
        for node in victims:
            start = self._end_hash(node.parent, node.key)
            hashes += page_hashes(start, node.key.raw_token_ids(), self.page_size)
            pages += (node.value[:: self.page_size] // self.page_size).tolist()
        if hashes:
            stored = self.lent.store(hashes, pages)
            logger.debug("lent tier: %d of %d evicted pages stored", stored, len(hashes))

    # -- match and load back ----------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if self.disable or self.lent is None or req is None or not self.lent.index:
            return base
        try:
            return self._match_lent(params, base, req)
        except Exception:  # a failed lookup is a miss, never a failed request
            logger.exception("lent tier: lookup for %s failed; prefilling instead", req.rid)
            self._markers.pop(req.rid, None)
            return base

    def _match_lent(self, params: MatchPrefixParams, base: MatchResult, req: Any
                    ) -> MatchResult:
        assert self.lent is not None
        key = params.key.page_aligned(self.page_size)
        done = base.device_prefix_len
        if done >= len(key):
            return base
        node = base.last_device_node
        tokens, size = key.raw_token_ids(), self.page_size
        hashes: list[bytes] = []
        h = self._end_hash(node, key)
        for begin in range(done, len(key) - size + 1, size):  # hash only as far as it hits
            h = page_hashes(h, tokens[begin: begin + size], size)[0]
            if not self.lent.lookup([h]):
                break
            hashes.append(h)
        hits = len(hashes)
        if hits == 0:
            self._markers.pop(req.rid, None)
            return base
        self._markers[req.rid] = _Marker(node, key[done: done + hits * size], hashes)
        self.lent.touch(hashes)  # about to be loaded: last in the tier's LRU order
        return base._replace(host_hit_length=hits * self.page_size)

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        node = params.best_match_node
        req = params.req
        marker = self._markers.pop(req.rid, None) if req is not None else None
        if self.lent is None or marker is None or marker.node is not node or \
                len(marker.tokens) != params.host_hit_length:
            return 0, node
        try:
            return self._load(node, marker)
        except Exception:  # a failed load is a recompute, never a failed request
            logger.exception("lent tier: loading %d tokens for %s failed; prefilling instead",
                             len(marker.tokens), req.rid)
            return 0, node

    def _load(self, node: TreeNode, marker: _Marker) -> tuple[int, Any]:
        assert self.lent is not None
        child = marker.tokens.child_key(self.page_size)
        if child in node.children:  # the same prefix was computed meanwhile
            return 0, node
        need = len(marker.tokens)
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < need:
            self.evict(EvictParams(num_tokens=need))
        slots = allocator.alloc(need)
        if slots is None:
            return 0, node
        page_ids = (slots[:: self.page_size] // self.page_size).tolist()
        try:
            loaded_ok = self.lent.load(marker.hashes, page_ids)
        except BaseException:
            allocator.free(slots)
            raise
        if not loaded_ok:
            allocator.free(slots)
            logger.info("lent tier: a lender took pages back before they loaded; recomputing "
                        "%d tokens", need)
            return 0, node
        loaded = TreeNode(priority=node.priority)
        loaded.key, loaded.value, loaded.parent = marker.tokens, slots.to(torch.int64), node
        loaded._fs_end = marker.hashes[-1]
        node.children[child] = loaded
        self.evictable_size_ += need
        self._update_leaf_status(node)
        self._update_leaf_status(loaded)
        self.kv_events.record_store(loaded)
        return need, loaded

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._markers.pop(req.rid, None)
        super().on_release(req, checkpointed=checkpointed)

    def reset(self) -> None:
        """The tree emptied (`/flush_cache`, and SGLang flushes after a weight update): the lent
        pages go too, as KV of weights that may have changed."""
        super().reset()
        if hasattr(self, "_markers"):
            self._markers.clear()
        if self.lent is not None:
            self.lent.release()

"""kvcached's KV memory, modelled for the simulator: 2 MB physical pages mapped on demand.

The paper's Prism* runs on fineslab's slabs; the `kvcached` system runs the same policies on
this model of kvcached's memory (the memory Prism's paper runs on), so the difference between
the two is what the slab mechanism buys. Read from kvcached's code
(github.com/ovg-project/kvcached, commit e8e6406):

    page size       2 MB (`kvcached/utils.py`, `_get_page_size`, KVCACHED_PAGE_SIZE_MB)
    block -> page   a block of `block_mem_size` = tokens_per_block * cell_size bytes (one layer,
                    K or V) lives in virtual page block_id * block_mem_size // page_size, and a
                    page holds page_size // block_mem_size blocks (`csrc/page_allocator.cpp`,
                    `get_page_id`, `InternalPage::get_num_blocks`)
    mapping         a page id is mapped for every layer and for K and V at once (the default
                    contiguous layout maps one compound page of page_size * L * 2 bytes;
                    the per-layer layout maps 2L pages: `csrc/allocator.cpp`,
                    `map_to_kv_tensors`); its physical memory is created when it is mapped
                    (`csrc/ftensor.cpp`, `FTensor::map` -> `GPUPage`: cuMemCreate, cuMemMap,
                    cuMemSetAccess)
    allocation      blocks come from partly used pages first (best fit), then a new page:
                    from the reserve (already mapped, no cost) or else mapped synchronously on
                    the allocating thread (`kvcached/kv_cache_manager.py`, `_alloc`,
                    `_pick_avail_page`; `PageAllocator::alloc_page`)
    reserve         a background thread keeps >= 5 pages mapped and unused (filled when the
                    allocator starts and whenever it drops below 5); a page whose last block
                    is freed joins the reserve while it holds < 10, else it is unmapped at
                    once, synchronously, on the freeing thread (KVCACHED_MIN_RESERVED_PAGES=5,
                    KVCACHED_MAX_RESERVED_PAGES=10: `PageAllocator::free_pages`,
                    `prealloc_worker`; here `SimConfig.page_reserve_min/max`)
    availability    own free blocks + (reserve + min(free virtual pages, free physical
                    pages)) * blocks per page: another engine's reserve takes physical memory
                    from this one (`KVCacheManager.available_size`)

Glossary (one lease = one replica's TP rank on one GPU; "group" = kvcached's page id)
    bytes_per_token    num_kv_heads_per_rank * head_dim * dtype bytes (+ INT4 scale/zero): one
                       token of one layer, K or V, on one rank (kvcached's cell_size)
    pages_per_group    2 * L physical 2 MB pages: mapping a group maps one page per layer,
                       for K and for V
    blocks_per_group   PAGE_BYTES // (tokens_per_block * bytes_per_token); tokens per group
                       P = blocks_per_group * tokens_per_block
    reserve            groups mapped but holding no block (this lease's only)

Constants of time (`SimConfig.page_map_s`, `page_set_access_s`; issue #18's anchors: about
1.5 us cuMemMap and 36 us cuMemSetAccess per 2 MB page). Mapping a group on the allocation
path costs pages_per_group * (map + set_access), charged to the step that allocates; a
synchronous unmap costs the same (FTensor::unmap re-maps the zero page, a map plus a set
access; cuMemUnmap and cuMemRelease are not anchored and not counted), charged to the
replica's next step. A TP replica's ranks map in parallel: its step pays the slowest rank.

What is modelled optimistically for kvcached (stated, not hidden): the background refill of
the reserve runs between two steps of the replica, off the critical path and instantly
(really it maps up to 5 groups, 5 * 2L * 37.5 us, about 12 ms for L = 32); the physical pool
is the same KV space the slab tables get (kvcached's 5% headroom, KVCACHED_GPU_UTILIZATION,
is not taken); kvcached's null block (SGLang's padding block) is not reserved.

Invariants (checked by `check_integrity`)
    per lease   used + free blocks in used groups == groups_in_use * blocks_per_group
                groups_in_use + reserve + unmapped == num_groups (its virtual space)
                a group in use holds >= 1 block; a reserve group holds none
    per pool    mapped_pages == sum over leases (groups_in_use + reserve) * pages_per_group
                mapped_pages <= num_pages
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from fineslab.errors import ArenaExhausted, ConfigError, IntegrityError, InvalidBlockError
from fineslab.slabs import BlockFormat

logger = logging.getLogger(__name__)

PAGE_BYTES = 2 << 20  # kvcached/utils.py: _get_page_size, the 2 MB default


class GpuPagePool:
    """One GPU's physical 2 MB pages, shared by every resident's leases (the driver's free
    memory, as kvcached's `get_avail_physical_pages` sees it)."""

    def __init__(self, gpu_id: int, kv_bytes: int) -> None:
        self.gpu_id = gpu_id
        self.num_pages = kv_bytes // PAGE_BYTES
        self.mapped_pages = 0
        self.leases: list[PageLease] = []

    @property
    def free_pages(self) -> int:
        return self.num_pages - self.mapped_pages

    def take(self, num_pages: int) -> None:
        if num_pages > self.free_pages:
            raise ArenaExhausted(f"GPU {self.gpu_id}: {num_pages} pages asked, "
                                 f"{self.free_pages} free")
        self.mapped_pages += num_pages

    def give(self, num_pages: int) -> None:
        self.mapped_pages -= num_pages

    def check_integrity(self) -> None:
        held = sum(lease.mapped_groups * lease.pages_per_group for lease in self.leases)
        if held != self.mapped_pages or not 0 <= self.mapped_pages <= self.num_pages:
            raise IntegrityError(f"GPU {self.gpu_id}: {self.mapped_pages} pages mapped, "
                                 f"leases hold {held}, pool has {self.num_pages}")


class PageLease:
    """One replica rank's kvcached allocator on one GPU: the `RuntimeSlabs` interface that
    `ReplicaKv` uses, plus `settle_step()` for the map time a step owes.

    Block ids: group g holds blocks [g * blocks_per_group, (g + 1) * blocks_per_group).
    """

    def __init__(self, pool: GpuPagePool, runtime_id: str, fmt: BlockFormat, *,
                 map_s_per_page: float, min_reserve: int, max_reserve: int) -> None:
        """`map_s_per_page`: map + set-access seconds of one 2 MB page; the reserve sizes in
        groups (kvcached's defaults, 5 and 10, are `SimConfig.page_reserve_min/max`)."""
        shape = fmt.shape
        self.pool, self.runtime_id, self.fmt = pool, runtime_id, fmt
        self.bytes_per_token = shape.layer_bytes // 2
        self.pages_per_group = 2 * shape.num_layers
        self.blocks_per_group = PAGE_BYTES // (fmt.tokens_per_block * self.bytes_per_token)
        if self.blocks_per_group < 1:
            raise ConfigError(f"{runtime_id}: a block of {fmt.tokens_per_block} tokens is "
                              f"larger than a {PAGE_BYTES} B page")
        if not 0 <= min_reserve <= max_reserve:
            raise ConfigError("page reserve sizes must satisfy 0 <= min <= max")
        self.map_s_per_group = self.pages_per_group * map_s_per_page
        self.min_reserve, self.max_reserve = min_reserve, max_reserve
        # The virtual space covers the whole GPU, as kvcached sizes it.
        self.num_groups = pool.num_pages // self.pages_per_group
        self.num_blocks_total = self.num_groups * self.blocks_per_group
        self._used = [0] * self.num_groups
        self._free_ids: dict[int, list[int]] = {}  # groups in use with free blocks
        self._full: set[int] = set()  # groups in use with no free block
        self._unmapped: deque[int] = deque(range(self.num_groups))
        self._reserve: deque[int] = deque()
        self._num_free_in_use = 0
        self._owed_s = 0.0
        pool.leases.append(self)
        self._refill_reserve()  # kvcached starts its prealloc thread with the allocator

    # -- accounting -----------------------------------------------------------------------------
    @property
    def tokens_per_group(self) -> int:
        return self.blocks_per_group * self.fmt.tokens_per_block

    @property
    def groups_in_use(self) -> int:
        return len(self._free_ids) + len(self._full)

    @property
    def mapped_groups(self) -> int:
        return self.groups_in_use + len(self._reserve)

    @property
    def num_reserved_groups(self) -> int:
        return len(self._reserve)

    def num_used_blocks(self) -> int:
        return self.groups_in_use * self.blocks_per_group - self._num_free_in_use

    def available_blocks(self) -> int:
        mappable = min(len(self._unmapped), self.pool.free_pages // self.pages_per_group)
        return self._num_free_in_use + (len(self._reserve) + mappable) * self.blocks_per_group

    # -- alloc / free ---------------------------------------------------------------------------
    def alloc(self, num_blocks: int) -> list[int]:
        """`num_blocks` ids: partly used groups first (best fit), then the reserve, then newly
        mapped groups (map time owed). ArenaExhausted, nothing held, when short."""
        if num_blocks > self.available_blocks():
            raise ArenaExhausted(f"{self.runtime_id}: {num_blocks} blocks asked, "
                                 f"{self.available_blocks()} available")
        taken: list[int] = []
        while len(taken) < num_blocks:
            group = self._pick_group(num_blocks - len(taken))
            free = self._free_ids.pop(group)
            count = min(len(free), num_blocks - len(taken))
            taken += free[:count]
            rest = free[count:]
            self._used[group] += count
            self._num_free_in_use -= count
            if rest:
                self._free_ids[group] = rest
            else:
                self._full.add(group)
        return taken

    def _pick_group(self, need: int) -> int:
        """kvcached's `_pick_avail_page`: the fullest group that still holds `need` blocks,
        else the emptiest; a new group only when no used group has a free block."""
        if self._free_ids:
            sizes = {g: len(ids) for g, ids in self._free_ids.items()}
            fits = [g for g, size in sizes.items() if size >= need]
            if fits:
                return min(fits, key=lambda g: (sizes[g], g))
            return max(sizes, key=lambda g: (sizes[g], -g))
        if self._reserve:
            group = self._reserve.popleft()
        else:
            group = self._unmapped.popleft()
            self.pool.take(self.pages_per_group)
            self._owed_s += self.map_s_per_group
        start = group * self.blocks_per_group
        self._free_ids[group] = list(range(start, start + self.blocks_per_group))
        self._num_free_in_use += self.blocks_per_group
        return group

    def free(self, block_ids: Iterable[int]) -> None:
        """Give blocks back; a group left empty joins the reserve (below its maximum) or is
        unmapped at once, its unmap time owed. InvalidBlockError on a block not in use."""
        by_group: dict[int, list[int]] = {}
        for block in block_ids:
            by_group.setdefault(block // self.blocks_per_group, []).append(block)
        for group, ids in by_group.items():
            if not 0 <= group < self.num_groups or self._used[group] < len(ids):
                raise InvalidBlockError(f"{self.runtime_id}: blocks {ids[:8]} not in use")
            self._full.discard(group)
            free = self._free_ids.setdefault(group, [])
            free += ids
            self._used[group] -= len(ids)
            self._num_free_in_use += len(ids)
            if self._used[group] == 0:
                del self._free_ids[group]
                self._num_free_in_use -= self.blocks_per_group
                self._release_group(group)

    def _release_group(self, group: int) -> None:
        if len(self._reserve) < self.max_reserve:
            self._reserve.append(group)
            return
        self.pool.give(self.pages_per_group)
        self._unmapped.append(group)
        self._owed_s += self.map_s_per_group

    # -- time -----------------------------------------------------------------------------------
    def settle_step(self) -> float:
        """The synchronous map/unmap seconds owed since the last call (the step about to start
        pays them); then the background thread refills the reserve, off the critical path."""
        owed, self._owed_s = self._owed_s, 0.0
        self._refill_reserve()
        return owed

    def _refill_reserve(self) -> None:
        """kvcached's `prealloc_worker`: map up to the minimum reserve, as far as free virtual
        groups and the pool's physical pages allow."""
        room = self.pool.free_pages // self.pages_per_group
        count = min(self.min_reserve - len(self._reserve), len(self._unmapped), room)
        for _ in range(max(0, count)):
            self._reserve.append(self._unmapped.popleft())
        self.pool.take(max(0, count) * self.pages_per_group)

    # -- checks and lifetime --------------------------------------------------------------------
    def check_integrity(self) -> None:
        in_use = set(self._free_ids) | self._full
        used = sum(self._used)
        free = sum(len(ids) for ids in self._free_ids.values())
        problems = []
        if used + free != len(in_use) * self.blocks_per_group or free != self._num_free_in_use:
            problems.append("used + free blocks differ from the groups in use")
        if len(in_use) + len(self._reserve) + len(self._unmapped) != self.num_groups:
            problems.append("groups in use, reserved and unmapped do not cover the space")
        if any(self._used[g] == 0 for g in in_use) or any(self._used[g] for g in self._reserve):
            problems.append("a group in use is empty or a reserved group holds blocks")
        if problems:
            raise IntegrityError(f"{self.runtime_id}: " + "; ".join(problems))

    def close(self) -> None:
        """Unmap everything (the replica's blocks die with it)."""
        self.pool.give(self.mapped_groups * self.pages_per_group)
        self.pool.leases.remove(self)
        self._free_ids, self._full, self._reserve = {}, set(), deque()
        self._unmapped = deque(range(self.num_groups))
        self._used = [0] * self.num_groups
        self._num_free_in_use = 0

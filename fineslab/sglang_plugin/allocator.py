"""SlabAllocator: SGLang's page allocator, drawing pages from this runtime's share of the arena.

Glossary
    block source   this runtime's allocator over the shared slab table (`fineslab.slabs`):
                   alloc(n) -> block ids (all or nothing), free(ids), available_blocks()
    page           SGLang's allocation unit; page id == arena block id (tokens_per_block ==
                   SGLang's page size), so page p holds slots [p * page_size, (p+1) * page_size)
    held page      a page this runtime drew from the block source and has not returned
    parked page    a held page never handed to SGLang: page 0, which SGLang reserves for
                   padded-token writes and never frees

Invariants (checked by `check_integrity`, which SGLang's idle check calls)
    num_held_pages == count(held_mask) == num_used_pages + num_parked_pages
    every page SGLang owns is held;  no page is held twice
    available_size() == min(source.available_blocks(), max_pages - num_used_pages) * page_size

There is no private free list: a page SGLang frees goes straight back to the block source, which
keeps it in this runtime's partial slab or returns the slab to the shared free space once it is
empty. So what this runtime does not use is always visible to its neighbours, and
`available_size` (what SGLang admits, retracts and evicts against) falls when a neighbour grows.
Cost: one call into the block source per alloc and per free (a few microseconds plus the list of
ids); SGLang's own kernels then pick slots from the drawn pages as usual.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages

from fineslab.errors import ArenaExhausted, InvalidBlockError

logger = logging.getLogger(__name__)

#: SGLang writes padded tokens to slot 0 and never allocates page 0.
PADDING_PAGE = 0


class BlockSource(Protocol):
    """What SlabAllocator needs from the per-runtime slab allocator."""

    def alloc(self, num_blocks: int) -> list[int]: ...

    def free(self, block_ids: list[int]) -> None: ...

    def available_blocks(self) -> int: ...


class SlabAllocator(PagedTokenToKVPoolAllocator):
    """A `PagedTokenToKVPoolAllocator` whose free pages live in the shared slab table.

    Serves page size 1 too (SGLang then calls `alloc` only). `size` is SGLang's capacity in
    tokens (the whole arena in this model's format, or less with `--max-total-tokens`); this
    runtime never uses more than `size // page_size` pages, wherever in the arena they are.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str,
                 kvcache: Any, need_sort: bool, *, source: BlockSource) -> None:
        # clear() runs inside the base constructor and needs these.
        self._source = source
        self._max_pages = size // page_size
        num_pages_total = kvcache.k_buffer[0].shape[0] // page_size
        self._held = torch.zeros(num_pages_total, dtype=torch.bool)
        self._num_held = 0
        self._parked: list[int] = []
        super().__init__(size, page_size, dtype, device, kvcache, need_sort=False)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    # -- capacity ---------------------------------------------------------------------------

    def available_size(self) -> int:
        """Tokens this runtime could allocate now: its free blocks plus the shared free slabs'."""
        room = self._max_pages - (self._num_held - len(self._parked))
        return max(0, min(self._source.available_blocks(), room)) * self.page_size

    def held_tokens(self) -> int:
        """Slots this runtime holds in the arena (used by SGLang or parked)."""
        return self._num_held * self.page_size

    def parked_tokens(self) -> int:
        return len(self._parked) * self.page_size

    # -- drawing and returning pages --------------------------------------------------------

    def _draw(self, num_pages: int) -> torch.Tensor | None:
        """`num_pages` fresh pages from the block source, or None if the arena cannot give them."""
        if num_pages <= 0:
            return self._empty
        if self._num_held - len(self._parked) + num_pages > self._max_pages:
            return None  # this runtime's cap (--max-total-tokens)
        try:
            ids = self._source.alloc(num_pages)
        except ArenaExhausted:
            return None
        if PADDING_PAGE in ids:
            # SGLang writes padded tokens into page 0 and never frees it: keep it held, unused.
            ids.remove(PADDING_PAGE)
            self._mark_held([PADDING_PAGE])
            self._parked.append(PADDING_PAGE)
            try:
                ids += self._source.alloc(1)
            except ArenaExhausted:
                self._source.free(ids)
                return None
        self._mark_held(ids)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _mark_held(self, ids: list[int]) -> None:
        index = torch.tensor(ids, dtype=torch.int64)
        if bool(self._held[index].any()):
            raise InvalidBlockError(f"block source handed out held pages {ids}")
        self._held[index] = True
        self._num_held += len(ids)

    def _return(self, page_ids: torch.Tensor) -> None:
        """Give pages back to the block source at once (no private free list)."""
        if page_ids.numel() == 0:
            return
        index = page_ids.to("cpu", torch.int64)
        if not bool(self._held[index].all()) or index.unique().numel() != index.numel():
            raise InvalidBlockError(
                f"SGLang freed pages this runtime does not hold: {index.tolist()[:16]}")
        self._held[index] = False
        self._num_held -= index.numel()
        self._source.free(index.tolist())

    # -- SGLang's allocator interface -------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = self._draw(need_size // self.page_size)
        if pages is None:
            return None
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        if num_new_pages is None:
            num_new_pages = int(get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu))
        pages = self._draw(num_new_pages)
        if pages is None:
            return None
        self.free_pages = pages
        try:
            out: torch.Tensor | None = super().alloc_extend(
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                extend_num_tokens, num_new_pages)
        finally:
            leftover, self.free_pages = self.free_pages, self._empty
        self._return(leftover)
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        num_new_pages = int(get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
        pages = self._draw(num_new_pages)
        if pages is None:
            return None
        self.free_pages = pages
        try:
            out: torch.Tensor | None = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        finally:
            leftover, self.free_pages = self.free_pages, self._empty
        self._return(leftover)
        return out

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # The base class's free(), free_page_ids() and free_group_end() all end here.
        for ids in page_ids:
            self._return(ids)

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: freed pages are already back in the slab table."""

    def get_all_free_pages(self) -> torch.Tensor:
        return self._empty

    def clear(self) -> None:
        """Return every held page (SGLang calls this at start and when it flushes its cache)."""
        held = torch.nonzero(self._held).flatten()
        if held.numel():
            self._held[:] = False
            self._num_held = 0
            self._parked = []
            self._source.free(held.tolist())
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_group = None
        self.free_page_ids_group: list[torch.Tensor] = []
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0

    # -- integrity --------------------------------------------------------------------------

    def check_integrity(self) -> list[str]:
        """Violations of this module's invariants (empty when healthy)."""
        problems = []
        if int(self._held.sum()) != self._num_held:
            problems.append(f"held count {self._num_held} != held pages {int(self._held.sum())}")
        if any(not bool(self._held[p]) for p in self._parked):
            problems.append(f"parked pages {self._parked} are not held")
        if self._num_held - len(self._parked) > self._max_pages:
            problems.append(f"holds {self._num_held} pages, cap {self._max_pages}")
        return problems

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle-time diagnostic: report broken invariants as a leak."""
        return [f"SlabAllocator: {p}" for p in self.check_integrity()]

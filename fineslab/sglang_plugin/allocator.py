"""SlabAllocator: SGLang's page allocator, drawing pages from this runtime's share of the arena.

Glossary
    block source   this runtime's allocator over the shared slab table (`RuntimeSlabs`):
                   alloc(n) -> block ids (all or nothing), free(ids), available_blocks()
    page           SGLang's allocation unit; page id == arena block id (tokens_per_block ==
                   SGLang's page size), so page p holds slots [p * page_size, (p+1) * page_size)
    held page      drawn from the block source and not yet given back
    reserved page  held, not yet handed to SGLang: drawn when SGLang *checks* capacity, so that
                   the allocation that follows cannot fail because a neighbour took the memory
    parked page    page 0, held and never handed out (SGLang's padding page)

Invariants (`check_integrity`; SGLang's idle check calls it through verify_byte_accounting)
    num_held == count(held_mask) == num_used + len(reserved) + len(parked)
    reserved, parked and the pages SGLang owns are disjoint subsets of the held pages
    num_used + len(reserved) <= max_pages           (SGLang's capacity, --max-total-tokens)
    available_size() == (len(reserved) + min(source.available_blocks(), room)) * page_size,
        room = max_pages - num_used - len(reserved)

Why a reservation: SGLang decides (admission, `check_decode_capacity`) and allocates later in
the same step; with a neighbour allocating from the same free slabs in between, a plain
"check available, then allocate" would fail the allocation, which SGLang treats as fatal. So
the checks draw the pages they promise, the allocations consume them, and what an allocation
did not need goes straight back. Between steps this runtime holds only the pages its requests
use: everything else is visible to its neighbours.
Cost: one call into the block source per check and per allocation (microseconds), plus a
tensor of the drawn ids.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.utils import get_num_new_pages

from fineslab.errors import ArenaExhausted, InvalidBlockError

logger = logging.getLogger(__name__)

#: SGLang writes padded tokens to slot 0 and never allocates page 0.
PADDING_PAGE = 0
#: How long a runtime whose last running request cannot get a page waits for its neighbours to
#: free arena memory before it lets SGLang abort that request (SGLang's own pool never gets
#: there: its admission keeps room for what it admitted; a shared arena can be taken in between).
#: Below SGLang's scheduler watchdog (300 s by default), which would kill a longer wait.
STARVED_WAIT_S = 60.0
STARVED_POLL_S = 0.01


class BlockSource(Protocol):
    """What SlabAllocator needs from the per-runtime slab allocator."""

    def alloc(self, num_blocks: int) -> list[int]: ...

    def free(self, block_ids: list[int]) -> None: ...

    def available_blocks(self) -> int: ...


def triton_pages_ok(page_size: int) -> bool:
    """Whether SGLang's Triton page-allocation kernels take `page_size`.

    They build `tl.arange(0, page_size)`, which Triton allows for powers of two only; their
    torch fallback (`alloc_extend_naive`, `alloc_decode_naive`) takes any page size, and slab
    plans use pages like 20 or 48 so that different models' blocks come out the same size.
    """
    return page_size > 0 and page_size & (page_size - 1) == 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SlabPrefillBudget(PrefillBudget):
    """SGLang's prefill budget, reserving the pages of each admitted prefill as it admits it."""

    allocator: SlabAllocator

    def can_allocate_prefill(self, *, paged_input: int, extend_input_len: int,
                             max_new_tokens: int, chunk_limit: int | None) -> bool:
        # Pages for everything admitted so far in this step plus this request (and the page
        # each request may open), drawn now so the batch's alloc_extend cannot come up short.
        tokens = self.current_offset + paged_input + self.page_size
        self.allocator.reserve_tokens(tokens)
        return super().can_allocate_prefill(
            paged_input=paged_input, extend_input_len=extend_input_len,
            max_new_tokens=max_new_tokens, chunk_limit=chunk_limit)


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
        self._held = torch.zeros(kvcache.k_buffer[0].shape[0] // page_size, dtype=torch.bool)
        self._num_held = 0
        self._reserved: list[int] = []
        self._parked: list[int] = []
        self._full_at_tokens: int | None = None  # see admission_reopens
        super().__init__(size, page_size, dtype, device, kvcache, need_sort=False)
        uses_triton: bool = self.use_triton_kernels  # type: ignore[has-type]
        self.use_triton_kernels = uses_triton and triton_pages_ok(page_size)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    # -- capacity ---------------------------------------------------------------------------

    def _num_used(self) -> int:
        return self._num_held - len(self._reserved) - len(self._parked)

    def available_size(self) -> int:
        """Tokens this runtime could allocate now: its reserve, its free blocks, and what the
        shared free slabs would give it."""
        room = self._max_pages - self._num_used() - len(self._reserved)
        shared = max(0, min(self._source.available_blocks(), room))
        return (len(self._reserved) + shared) * self.page_size

    def used_tokens(self) -> int:
        """Slots SGLang owns (requests and its prefix cache)."""
        return self._num_used() * self.page_size

    def admission_reopens(self, batch_is_full: bool) -> bool:
        """Whether to clear SGLang's `batch_is_full` before its next admission attempt.

        SGLang sets the flag when a waiting request did not fit, and clears it only when one of
        this runtime's own requests leaves: it assumes nobody else frees its memory. In an arena
        a neighbour's finished requests free memory too, and waiting requests would sit until one
        of ours ended. So: remember the least available size seen while the flag is set, and
        reopen admission as soon as the available size is above it (a neighbour, or a finished
        request, gave memory back). A reopened attempt that still does not fit sets the flag
        again; the cost is one admission pass per increase, none while the flag is clear.
        """
        if not batch_is_full:
            self._full_at_tokens = None
            return False
        available = self.available_size()
        if self._full_at_tokens is not None and available > self._full_at_tokens:
            self._full_at_tokens = None
            return True
        if self._full_at_tokens is None or available < self._full_at_tokens:
            self._full_at_tokens = available
        return False

    # -- reservation ------------------------------------------------------------------------

    def reserve_tokens(self, num_tokens: int) -> bool:
        """Hold pages for `num_tokens` tokens until the next allocation; False if short."""
        return self._top_up(_ceil_div(num_tokens, self.page_size))

    def _top_up(self, num_pages: int) -> bool:
        short = num_pages - len(self._reserved)
        if short <= 0:
            return True
        if self._num_used() + num_pages > self._max_pages:
            return False
        try:
            ids = self._source.alloc(short)
        except ArenaExhausted:
            return False
        self._mark_held(ids)
        if PADDING_PAGE in ids:
            # SGLang writes padded tokens into page 0: keep it held and unused, draw again.
            ids.remove(PADDING_PAGE)
            self._parked.append(PADDING_PAGE)
            self._reserved += ids
            return self._top_up(num_pages)
        self._reserved += ids
        return True

    def _take(self, num_pages: int) -> torch.Tensor | None:
        """`num_pages` pages for SGLang, from the reserve first; None if the arena is short."""
        if num_pages <= 0:
            return self._empty
        if not self._top_up(num_pages):
            return None
        ids, self._reserved = self._reserved[:num_pages], self._reserved[num_pages:]
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def release_reserve(self) -> None:
        """Give the reserved pages back to the block source (after each allocation)."""
        if self._reserved:
            ids, self._reserved = self._reserved, []
            self._unmark_held(torch.tensor(ids, dtype=torch.int64))
            self._source.free(ids)

    def _mark_held(self, ids: list[int]) -> None:
        index = torch.tensor(ids, dtype=torch.int64)
        if bool(self._held[index].any()):
            raise InvalidBlockError(f"block source handed out held pages {ids[:16]}")
        self._held[index] = True
        self._num_held += len(ids)

    def _unmark_held(self, index: torch.Tensor) -> None:
        if not bool(self._held[index].all()) or index.unique().numel() != index.numel():
            raise InvalidBlockError(
                f"pages freed that this runtime does not hold: {index.tolist()[:16]}")
        self._held[index] = False
        self._num_held -= index.numel()

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # The base class's free(), free_page_ids() and free_group_end() all end here: pages go
        # straight back to the block source (no private free list).
        for ids in page_ids:
            if ids.numel():
                index = ids.to("cpu", torch.int64)
                self._unmark_held(index)
                self._source.free(index.tolist())

    # -- SGLang's allocator interface -------------------------------------------------------

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
                              ) -> SlabPrefillBudget:
        return SlabPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Reserve the next decode step's pages. Short with several requests running: False,
        and SGLang retracts some of them (their pages go back). Short with one request left,
        which SGLang would abort: wait for the neighbours to free memory (`STARVED_WAIT_S`)."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        if self.reserve_tokens(num_tokens):
            return True
        if requests is None or len(requests) != 1:
            return False
        return self._wait_for_neighbours(num_tokens)

    def _wait_for_neighbours(self, num_tokens: int) -> bool:
        num_pages = _ceil_div(num_tokens, self.page_size)
        if self._num_used() + num_pages > self._max_pages:
            return False  # this runtime's own cap, not a neighbour: waiting cannot help
        logger.warning("the arena is full: this runtime's last running request waits up to "
                       "%.0f s for neighbours to free %d page(s)", STARVED_WAIT_S, num_pages)
        start = time.monotonic()
        while time.monotonic() - start < STARVED_WAIT_S:
            time.sleep(STARVED_POLL_S)
            if self.reserve_tokens(num_tokens):
                logger.info("arena memory freed after %.2f s: decoding resumes",
                            time.monotonic() - start)
                return True
        logger.error("no arena memory freed in %.0f s: SGLang aborts the request",
                     STARVED_WAIT_S)
        return False

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = self._take(need_size // self.page_size)
        self.release_reserve()
        if pages is None or self.page_size == 1:
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
        return self._with_pages(num_new_pages, lambda: super(SlabAllocator, self).alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
            num_new_pages))

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        num_new_pages = int(get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
        return self._with_pages(num_new_pages, lambda: super(SlabAllocator, self).alloc_decode(
            seq_lens, seq_lens_cpu, last_loc))

    def _with_pages(self, num_pages: int, kernel: Any) -> torch.Tensor | None:
        """Run SGLang's slot-picking kernel over exactly `num_pages` freshly taken pages."""
        pages = self._take(num_pages)
        self.release_reserve()
        if pages is None:
            return None
        self.free_pages = pages
        try:
            out: torch.Tensor | None = kernel()
        finally:
            leftover, self.free_pages = self.free_pages, self._empty
        self._release_page_ids(leftover)
        return out

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
            self._source.free(held.tolist())
        self._reserved, self._parked = [], []
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
        private = self._reserved + self._parked
        if len(set(private)) != len(private) or not all(bool(self._held[p]) for p in private):
            problems.append("reserved/parked pages are not distinct held pages")
        if self._num_used() + len(self._reserved) > self._max_pages:
            problems.append(f"uses {self._num_used()} pages, cap {self._max_pages}")
        return problems

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle-time diagnostic: report broken invariants as a leak."""
        return [f"SlabAllocator: {p}" for p in self.check_integrity()]

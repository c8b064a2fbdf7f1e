"""SlabAllocator: SGLang's page allocator, drawing pages from this runtime's share of the arena.

Glossary
    block source   this runtime's allocator over the shared slab table (`RuntimeSlabs`):
                   alloc(n) -> block ids (all or nothing, lowest slab first), free(ids),
                   available_blocks(), blocks_per_slab
    page           SGLang's allocation unit; page id == arena block id (tokens_per_block ==
                   SGLang's page size), so page p holds slots [p * page_size, (p+1) * page_size)
    held page      drawn from the block source and not yet given back
    reserved page  held, not yet handed to SGLang: drawn when SGLang *checks* capacity, so that
                   the allocation that follows cannot fail because a neighbour took the memory
    padding slab   slab 0 of the arena = pages [0, padding_pages) of every format, with
                   padding_pages = blocks_per_slab. SGLang writes padded tokens to slot 0
    parked page    a padding-slab page this runtime drew: held, never handed to SGLang

Invariants (`check_integrity`; SGLang's idle check calls it through verify_byte_accounting)
    num_held == count(held_mask) == num_used + len(reserved) + len(parked)
    reserved, parked and the pages SGLang owns are disjoint subsets of the held pages
    parked pages < padding_pages <= reserved pages and every page SGLang owns
    num_used + len(reserved) <= max_pages           (SGLang's capacity, --max-total-tokens)
    available_size() == (len(reserved) + min(source.available_blocks(), room)) * page_size,
        room = max_pages - num_used - len(reserved)

Why a reservation: SGLang decides (admission, `check_decode_capacity`) and allocates later in
the same step; with a neighbour allocating from the same free slabs in between, a plain
"check available, then allocate" would fail the allocation, which SGLang treats as fatal. So
the checks draw the pages they promise (`SlabPrefillBudget` on every admission path,
`check_decode_capacity` for decode), the allocations consume them, and what an allocation did
not need goes straight back. Pages this runtime's own prefix cache can free are not drawn at
admission (nobody else can take them); an allocation that then finds the arena's free pages
gone evicts its own cache before it gives up (`_evict_for`). Between steps this runtime holds
only the pages its requests use: everything else is visible to its neighbours. A check that
cannot be met says no at once (never waits: waiting is policy, `starvation.py`, and would block
SGLang's scheduler loop). Cost: one call into the block source per check and per allocation
(microseconds), plus a tensor of the drawn ids.

Why the whole padding slab is reserved (parked), not just page 0: SGLang writes every padded
token to slot 0 of the writer's own view (CUDA-graph and CPU-graph batch padding, and graph
capture at start-up, while the neighbours already serve). Slot 0 of every format is byte 0 of
the arena, and a token stride never exceeds a slab, so all those writes land in slab 0 and
nowhere else. Parking only one's own page 0 protects one's own KV; a neighbour whose token
stride exceeds the block of slab 0's holder (a page-1 holder, for instance) would write into
the holder's next block. With no page of slab 0 ever handed to SGLang, no runtime's KV lives
where any format's padding lands, whatever the formats, pages and graph settings of the
neighbours. Refusing CUDA graphs would close it too, but costs the GPU its decode speed-up
(graphs are SGLang's default on CUDA) and would have to list every other padding path (CPU
graphs, graph capture). Cost: one slab of the arena holds no KV (1/num_slabs: 4% of the 24-slab
test arena, 0.1% of a 1,000-slab GPU arena); whichever runtime first draws from slab 0 holds it,
parked. `available_size` leaves slab 0's blocks out while slab 0 is free, so it never promises
SGLang room the parking then takes (a prefill admitted on it ran out of memory and killed the
runtime).

Zeroed pages: with `page_bytes` given (on CUDA, `needs_zeroed_pages`), every page is zeroed as
SGLang gets it. A page may hold stale bytes of another format (a slab freed and carved again, or
a key-pool neighbour's block), which can be NaN in this one; a GPU kernel that loads a page's
unwritten tail and masks it by multiplying by 0 would turn NaN into NaN. On CPU SGLang's
torch_native backend gathers only the written slots, so nothing stale is ever read: no zeroing.
Cost on a GPU: one `index_fill_` over the new pages per allocation (their bytes once).
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
from fineslab.sglang_plugin.cache_squeeze import CacheSqueeze, evictable_tokens
from fineslab.slabs.table import SlabTable

logger = logging.getLogger(__name__)

#: How long an allocation the arena cannot serve waits for neighbours (s), and how often it
#: tries again meanwhile (`SlabAllocator._wait_for`).
STARVED_WAIT_S = 10.0
STARVED_POLL_S = 0.01


class BlockSource(Protocol):
    """What SlabAllocator needs from the per-runtime slab allocator."""

    blocks_per_slab: int
    table: SlabTable  # the device's slab table, and this runtime's slot in it (the lent
    slot: int         # tier of prefix_tier.py takes free slabs there)

    def alloc(self, num_blocks: int) -> list[int]: ...

    def free(self, block_ids: list[int]) -> None: ...

    def available_blocks(self) -> int: ...

    def padding_slab_free(self) -> bool: ...

    def limit_blocks(self) -> int | None: ...

    def release_cache(self) -> int: ...


def needs_zeroed_pages(device: str) -> bool:
    """Whether pages must be zeroed before SGLang gets them on `device` (see the module doc)."""
    return torch.device(device).type == "cuda"


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
    """SGLang's prefill budget, drawing from the arena the pages of each prefill it admits.

    SGLang counts free memory (`available_size`, the arena's free slabs included) when it admits
    a prefill and allocates later in the step. A neighbour that carved a slab in between (a
    waking model's weights, another runtime's prefill) made that allocation fail, which SGLang
    treats as fatal ("Prefill out of memory"; two rehearsals of the suite lost a runtime so). So
    every admission says yes only with the pages of the step's prefills held (`_hold`), on each
    of SGLang's three admission paths: `check_prefill` (every request), `can_allocate_prefill`
    (ignore-eos requests and request-slot reserves) and `available_chunk_tokens` (the next chunk
    of a chunked prefill, which SGLang's single pool lets go ahead unchecked).
    """

    allocator: SlabAllocator

    def _evictable(self) -> int:
        return evictable_tokens(self.tree_cache)

    def _hold(self, tokens: int) -> bool:
        """Reserve the arena pages for `tokens` tokens of this step's prefills, less what this
        runtime's own prefix cache can free (no neighbour can take those pages, and
        `evict_to_free_tokens` keeps what it evicts); False at once when the arena is short."""
        tokens = max(0, tokens - self._evictable())
        if self.allocator.reserve_tokens(tokens):
            return True
        self.allocator.ask_neighbours(tokens)
        return False

    def _step_tokens(self, extend_tokens: int) -> int:
        """Everything admitted so far in this step plus this prefill, and the page it may open
        where this runtime's capacity leaves one: a prompt SGLang admits that fills the
        capacity to its last page (1,010 tokens under --max-total-tokens 1024, page 16) asked
        for a page past it and was never admitted, a request that hung for ever."""
        needed = self.current_offset + self.ceil_paged_tokens(extend_tokens)
        return max(needed, min(needed + self.page_size, self.allocator.room_tokens()))

    def check_prefill(self, *, extend_input_len: int, total_tokens: int, max_new_tokens: int,
                      input_tokens: int, swa_host_hit_length: int, chunk_limit: int | None,
                      auxiliary_swa_host_hit_length: int = 0) -> tuple[bool, int | None]:
        fits, limit = super().check_prefill(
            extend_input_len=extend_input_len, total_tokens=total_tokens,
            max_new_tokens=max_new_tokens, input_tokens=input_tokens,
            swa_host_hit_length=swa_host_hit_length, chunk_limit=chunk_limit,
            auxiliary_swa_host_hit_length=auxiliary_swa_host_hit_length)
        if not fits:  # SGLang's own check refuses on memory only (its prefill_budget.py)
            self.allocator.ask_neighbours(
                self.total_offset + total_tokens + self.page_size - self._evictable())
            return fits, limit
        first = extend_input_len if limit is None else min(extend_input_len, limit)
        if not self._hold(self._step_tokens(first)):
            return False, None
        return fits, limit

    def can_allocate_prefill(self, *, paged_input: int, extend_input_len: int,
                             max_new_tokens: int, chunk_limit: int | None) -> bool:
        return self._hold(self.current_offset + paged_input + self.page_size) and \
            super().can_allocate_prefill(
                paged_input=paged_input, extend_input_len=extend_input_len,
                max_new_tokens=max_new_tokens, chunk_limit=chunk_limit)

    def available_chunk_tokens(self, chunk_limit: int) -> int | None:
        """The next chunk of a chunked prefill: SGLang's size (up to `chunk_limit`, the whole
        limit when its count is spent: its single pool's memory was promised at admission), else
        what the arena and the prefix cache hold now, else None: the chunk waits a step (SGLang
        parks it, as for hybrid SWA). A neighbour may hold the memory a single pool would have
        kept for it."""
        wanted = super().available_chunk_tokens(chunk_limit) or chunk_limit
        now = self.allocator.available_size() + self._evictable() - self.current_offset
        fallback = (now - self.page_size) // self.page_size * self.page_size
        for tokens in dict.fromkeys((wanted, min(wanted, fallback))):  # each size once
            if tokens > 0 and self._hold(self._step_tokens(tokens)):
                return tokens
        return None


class SlabAllocator(PagedTokenToKVPoolAllocator):
    """A `PagedTokenToKVPoolAllocator` whose free pages live in the shared slab table.

    Serves page size 1 too (SGLang then calls `alloc` only). `size` is SGLang's capacity in
    tokens (the arena outside the padding slab in this model's format, or less with
    `--max-total-tokens`); this runtime never uses more than `size // page_size` pages, wherever
    in the arena they are. `page_bytes`: the arena as [pages, block bytes] uint8, given where
    pages must be zeroed before SGLang gets them (`needs_zeroed_pages`).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str,
                 kvcache: Any, need_sort: bool, *, source: BlockSource,
                 page_bytes: torch.Tensor | None = None, squeeze: bool = True) -> None:
        # clear() runs inside the base constructor and needs these.
        self._source = source
        self._keep_freed = False
        #: While `_evict_for` evicts: available_size counts only the pages in hand.
        self._in_hand_only = False
        self._padding_pages = source.blocks_per_slab
        self._page_bytes = page_bytes
        self._max_pages = size // page_size
        self._held = torch.zeros(kvcache.k_buffer[0].shape[0] // page_size, dtype=torch.bool)
        self._num_held = 0
        self._reserved: list[int] = []
        self._parked: list[int] = []
        self._full_at_tokens: int | None = None  # see admission_reopens
        self._tree_cache: Any = None  # SGLang's prefix cache, for _evict_for
        #: the cache squeeze, both ways (None: `FINESLAB_CACHE_SQUEEZE=0`)
        self._squeeze = CacheSqueeze(source.table) if squeeze else None
        super().__init__(size, page_size, dtype, device, kvcache, need_sort=False)
        uses_triton: bool = self.use_triton_kernels  # type: ignore[has-type]
        self.use_triton_kernels = uses_triton and triton_pages_ok(page_size)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    # -- capacity ---------------------------------------------------------------------------

    def _num_used(self) -> int:
        return self._num_held - len(self._reserved) - len(self._parked)

    def available_size(self) -> int:
        """Tokens this runtime could allocate now: its reserve, its free blocks, and what the
        shared free slabs would give it, less the padding slab while it is free (the draw that
        reaches it parks it whole). Counting it let SGLang admit a prefill one slab larger than
        the arena could give ("Prefill out of memory", a crash: found once weights stopped
        taking slab 0, which then stayed free for the first KV draw)."""
        if self._in_hand_only:
            return len(self._reserved) * self.page_size
        room = self._max_pages - self._num_used() - len(self._reserved)
        free = self._source.available_blocks()
        if self._source.padding_slab_free():
            free -= self._padding_pages
        shared = max(0, min(free, room))
        return (len(self._reserved) + shared) * self.page_size

    def used_tokens(self) -> int:
        """Slots SGLang owns (requests and its prefix cache)."""
        return self._num_used() * self.page_size

    def room_tokens(self) -> int:
        """Tokens this runtime may still hold within its capacity (`size`), wherever they are."""
        return (self._max_pages - self._num_used()) * self.page_size

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
        """Hold pages for `num_tokens` tokens until the next allocation; False at once if short."""
        return self._top_up(_ceil_div(num_tokens, self.page_size))

    def cap_allows(self, num_tokens: int) -> bool:
        """Whether `num_tokens` more tokens stay within this runtime's own capacity and its KV
        limit (`fineslab ctl limit`): when a reservation fails although they do, the
        neighbours hold the memory; when they do not, waiting frees nothing."""
        pages = _ceil_div(num_tokens, self.page_size)
        limit = self._source.limit_blocks()
        # Parked padding pages are not KV: the limit does not count them (slabs/pooled.py).
        within_limit = limit is None or self._num_used() + pages <= limit
        return within_limit and self._num_used() + pages <= self._max_pages

    def _top_up(self, num_pages: int) -> bool:
        """Reserve up to `num_pages` pages, parking any padding-slab page drawn on the way.

        Once a draw returns a padding page, the next draw asks for just the rest of the padding
        slab: less than a slab, so the block source takes it from this runtime's lowest partial
        slab, slab 0, and a page-1 format with thousands of blocks a slab parks them in one
        draw. Anything else that draw brings serves the reservation; a surplus goes back.
        """
        if len(self._reserved) >= num_pages:
            return True
        if self._num_used() + num_pages > self._max_pages:
            return False
        rest_of_padding = 0
        while (short := num_pages - len(self._reserved)) > 0:
            try:
                ids = self._source.alloc(rest_of_padding or short)
            except ArenaExhausted:
                if not rest_of_padding:
                    return False
                rest_of_padding = 0
                continue
            self._mark_held(ids)
            padding = [i for i in ids if i < self._padding_pages]
            self._parked += padding
            self._reserved += [i for i in ids if i >= self._padding_pages]
            rest_of_padding = self._padding_pages - len(self._parked) if padding else 0
        self._release_surplus(num_pages)
        return True

    def ask_neighbours(self, num_tokens: int) -> bool:
        """A reservation of `num_tokens` (this runtime's own prefix cache counted already)
        found the arena short: post a cache squeeze for the free slabs it lacks, where this
        runtime's cap and KV limit allow the tokens (else the neighbours' memory would not
        help). Returns whether it posted (`cache_squeeze.py`)."""
        if self._squeeze is None:
            return False
        pages = _ceil_div(num_tokens, self.page_size)
        deficit = pages - self.available_size() // self.page_size
        if deficit <= 0 or not self.cap_allows(pages * self.page_size):
            return False
        wanted = self._source.table.free_slab_count() + \
            _ceil_div(deficit, self._source.blocks_per_slab)
        return self._squeeze.post(wanted)

    def give_cache_back(self, tree_cache: Any) -> int:
        """At the start of a scheduler turn: if a neighbour posted a cache squeeze, evict this
        runtime's unreferenced prefix cache until the arena has the free slabs it wanted;
        returns the tokens evicted (`cache_squeeze.py`)."""
        self._tree_cache = tree_cache
        if self._squeeze is None:
            return 0
        return self._squeeze.obey(tree_cache, self.page_size, self._source.blocks_per_slab)

    def _release_surplus(self, num_pages: int) -> None:
        """Give back what a draw for the padding slab brought beyond `num_pages` (the cap
        bounds used + reserved pages)."""
        if len(self._reserved) > num_pages:
            surplus, self._reserved = self._reserved[num_pages:], self._reserved[:num_pages]
            self._unmark_held(torch.tensor(surplus, dtype=torch.int64))
            self._source.free(surplus)

    def _take(self, num_pages: int) -> torch.Tensor | None:
        """`num_pages` pages for SGLang, from the reserve first; None if the arena is short."""
        if num_pages <= 0:
            return self._empty
        if not self._top_up(num_pages) and not self._evict_for(num_pages):
            return None
        ids, self._reserved = self._reserved[:num_pages], self._reserved[num_pages:]
        pages = torch.tensor(ids, dtype=torch.int64, device=self.device)
        if self._page_bytes is not None:
            self._page_bytes.index_fill_(0, pages.to(self._page_bytes.device), 0)
        return pages

    def _evict_for(self, num_pages: int) -> bool:
        """An allocation's last resort when the arena came up short: evict this runtime's own
        prefix cache into the reserve until the pages in hand cover the allocation, draw the
        rest, and failing that wait up to STARVED_WAIT_S for neighbours to give pages back.
        The admission held only what the prefix cache could not free
        (`SlabPrefillBudget._hold`), and SGLang's eviction right before the allocation evicts
        nothing while the arena's free slabs cover it; a neighbour that takes those slabs in
        between would otherwise fail the allocation, fatally ("Prefill out of memory": the
        runtime dies with every request it holds). The eviction here counts only the pages in
        hand (`_in_hand_only`), not the arena's free pages: a neighbour busy in the same arena
        took those once already, and did again in the live capacity benchmark, where an
        eviction that counted them freed nothing and the runtime died."""
        if self._tree_cache is None or not self._tree_cache.supports_prefix_sharing():
            return self._wait_for(num_pages)
        logger.info("the arena's free pages went to a neighbour before this allocation of %d "
                    "page(s); evicting this runtime's own prefix cache", num_pages)
        self._keep_freed = self._in_hand_only = True
        try:
            super().evict_to_free_tokens(self._tree_cache, num_pages * self.page_size)
        finally:
            self._keep_freed = self._in_hand_only = False
        return self._top_up(num_pages) or self._wait_for(num_pages)

    def _wait_for(self, num_pages: int) -> bool:
        """Draw `num_pages` again every STARVED_POLL_S for up to STARVED_WAIT_S: the pages a
        neighbour's requests hold come back as they finish. The scheduler waits meanwhile; an
        allocation that fails kills it. Only when neighbours hold the memory: past this
        runtime's own capacity or KV limit (`cap_allows`) nothing would come back."""
        if not self.cap_allows(num_pages * self.page_size):
            return False
        logger.warning("an allocation of %d page(s) is short in the arena with nothing of its "
                       "own left to evict; waiting up to %.0f s for neighbours to give pages "
                       "back", num_pages, STARVED_WAIT_S)
        deadline = time.monotonic() + STARVED_WAIT_S
        while time.monotonic() < deadline:
            self.ask_neighbours(num_pages * self.page_size)  # spaced by cache_squeeze's gap
            time.sleep(STARVED_POLL_S)
            if self._top_up(num_pages):
                return True
        logger.error("an allocation of %d page(s) found no room in the arena for %.0f s",
                     num_pages, STARVED_WAIT_S)
        return False

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
        # straight back to the block source (no private free list), except while SGLang evicts
        # for an allocation (`evict_to_free_tokens`): then they stay held, in the reserve.
        for ids in page_ids:
            if ids.numel():
                index = ids.to("cpu", torch.int64)
                if self._keep_freed:
                    self._reserved += index.tolist()
                    continue
                self._unmark_held(index)
                self._source.free(index.tolist())

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> Any:
        """SGLang evicts its prefix cache right before an allocation (`alloc_for_extend`,
        `alloc_for_decode`, `check_decode_capacity`) when the allocation would come up short.
        The pages that frees stay this runtime's, in the reserve, with what the arena has now:
        given back to the arena, a neighbour could take them in the moment before the
        allocation, which then fails and kills the runtime ("Prefill out of memory", found by
        the long fuzz run against the demo fleet).

        Nothing happens when the allocation fits already (SGLang's own rule): each decode step
        asks for a page per request whether or not it opens one, and reserving that page every
        step would draw it from the shared table and give it back each time.
        """
        self._tree_cache = tree_cache
        if self.available_size() >= num_tokens:
            return super().evict_to_free_tokens(tree_cache, num_tokens)
        self.reserve_tokens(num_tokens)  # what the arena has, before a neighbour takes it
        self._keep_freed = True
        try:
            result = super().evict_to_free_tokens(tree_cache, num_tokens)
        finally:
            self._keep_freed = False
        self.reserve_tokens(num_tokens)
        return result

    # -- SGLang's allocator interface -------------------------------------------------------

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
                              ) -> SlabPrefillBudget:
        self._tree_cache = tree_cache
        return SlabPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Reserve the next decode step's pages; False at once when the arena is short, and
        SGLang retracts (a lone starved request is held by the scheduler hook, `starvation.py`,
        before SGLang gets here)."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        if self.reserve_tokens(num_tokens):
            return True
        self.ask_neighbours(num_tokens)  # its own cache is evicted: the neighbours hold it
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
        if any(p >= self._padding_pages for p in self._parked) or \
                any(p < self._padding_pages for p in self._reserved):
            problems.append(f"a parked page outside, or a reserved page inside, the padding "
                            f"slab (pages < {self._padding_pages})")
        if self._num_used() + len(self._reserved) > self._max_pages:
            problems.append(f"uses {self._num_used()} pages, cap {self._max_pages}")
        return problems

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle-time diagnostic (called only when the scheduler is fully idle: nothing
        running, nothing waiting): report broken invariants as a leak, and give back a reserve
        that no allocation took, which an idle runtime can never need. Kept, it is memory no
        neighbour can get: CI once saw an idle runtime hold a reserved page after a burst, and
        its neighbour could then not admit a pair of requests that fit the rest of the arena.
        A key-pool source's block cache goes back too, for the same reason."""
        problems = [f"SlabAllocator: {p}" for p in self.check_integrity()]
        if self._reserved and not problems:
            logger.info("idle with %d reserved pages that no allocation took; giving them "
                        "back to the arena", len(self._reserved))
            self.release_reserve()
        released = self._source.release_cache()  # a key pool's block cache (slabs/pooled.py)
        if released:
            logger.info("idle: gave back the %d block(s) its key-pool cache held", released)
        return problems

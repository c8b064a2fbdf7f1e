"""SlabAllocator over a real slab table: SGLang's allocator interface, page by page.

No SGLang runtime here: SGLang's own allocator base class and the plugin's pool, on a CPU arena
created by the test, with a second runtime in the same table playing the neighbour.

    arena: 8 slabs x 4 blocks (16 tokens each) = 32 pages of "m"
    slab 0 = pages 0-3: the padding slab (SGLang's padded writes land there): parked, never KV
    SGLang's capacity: 28 pages (slabs 1-7)
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
import torch
from plugin_test_support import ScratchArena, slab_allocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from fineslab.sglang_plugin.allocator import SlabAllocator, needs_zeroed_pages, triton_pages_ok
from fineslab.slabs import KVDtype, KVShape, RuntimeSlabs
from fineslab.slabs.sizing import fit_format

PAGE = 16
SHAPE = KVShape("m", 2, 2, 64, KVDtype.BF16)  # 1,024 B a token, 16 KiB a block
SLAB_BYTES = 64 << 10
NUM_SLABS = 8
BPS = 4  # blocks a slab = the padding slab's pages


@pytest.fixture(autouse=True)
def _short_starved_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation the arena cannot serve waits STARVED_WAIT_S for neighbours before it
    fails; here nobody gives memory back unless a test says so (the wait's own tests set it)."""
    from fineslab.sglang_plugin import allocator as module

    monkeypatch.setattr(module, "STARVED_WAIT_S", 0.05)


@pytest.fixture
def setup() -> Iterator[tuple[SlabAllocator, RuntimeSlabs, RuntimeSlabs, ScratchArena]]:
    arena = ScratchArena.create(SLAB_BYTES, NUM_SLABS, 4)
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None and fmt.blocks_per_slab(SLAB_BYTES) == 4
    source = arena.arena.client("m", fmt)
    neighbour = arena.arena.client("n", fmt)
    allocator = slab_allocator(arena, source, fmt, PAGE, (NUM_SLABS - 1) * BPS * PAGE)
    yield allocator, source, neighbour, arena
    source.close()
    neighbour.close()
    arena.close()


def _check(allocator: SlabAllocator, source: RuntimeSlabs) -> None:
    assert allocator.check_integrity() == [], allocator.check_integrity()
    source.check_integrity()


def test_random_alloc_free_keeps_every_invariant(setup: tuple) -> None:
    allocator, source, _, _ = setup
    rng = random.Random(0)
    live: list[torch.Tensor] = []
    for _ in range(300):
        if live and (rng.random() < 0.45 or allocator.available_size() < 4 * PAGE):
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            out = allocator.alloc(rng.randint(1, 4) * PAGE)
            assert out is not None, "alloc within available_size must succeed"
            pages = (out // PAGE).unique()
            assert int(pages.min()) >= BPS, "no page of the padding slab is handed to SGLang"
            live.append(out)
        _check(allocator, source)
    for out in live:
        allocator.free(out)
    _check(allocator, source)
    assert allocator.used_tokens() == 0
    assert source.num_used_blocks() <= BPS, "only the parked padding slab may stay held"


def test_empty_slabs_go_back_and_a_neighbour_shrinks_available(setup: tuple) -> None:
    allocator, source, neighbour, arena = setup
    total = allocator.available_size()
    out = allocator.alloc(6 * PAGE)
    assert out is not None
    taken = neighbour.alloc(4 * 4)  # four whole slabs
    assert allocator.available_size() <= total - 6 * PAGE - 16 * PAGE, (
        "a neighbour's slabs must leave this runtime's available_size")
    neighbour.free(taken)
    allocator.free(out)
    used = arena.used_bytes()
    assert used.get("n", 0) == 0 and used.get("m", 0) <= SLAB_BYTES, (
        f"freed pages must go back to the free space at once (the padding slab stays): {used}")
    _check(allocator, source)


def test_checked_capacity_survives_a_neighbour_grabbing_the_rest(setup: tuple) -> None:
    allocator, source, neighbour, _ = setup
    # A whole slab's pages, so that the reserve fills slab 1 (slab 0 is parked).
    assert allocator.check_decode_capacity(num_tokens=BPS * PAGE, tree_cache=None)
    grabbed = neighbour.alloc(neighbour.available_blocks())  # everything still free
    assert allocator.available_size() == BPS * PAGE, "what the check reserved stays available"
    out = allocator.alloc(BPS * PAGE)
    assert out is not None, "an allocation after a passed check must not fail"
    assert allocator.alloc(PAGE) is None, "with the arena full, a new allocation fails cleanly"
    assert not allocator.check_decode_capacity(num_tokens=PAGE, tree_cache=None)
    neighbour.free(grabbed)
    allocator.free(out)
    _check(allocator, source)


def test_cap_from_max_total_tokens_is_respected(setup: tuple) -> None:
    _, _, _, arena = setup
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None
    capped_source = arena.arena.client("c", fmt)
    try:
        capped = slab_allocator(arena, capped_source, fmt, PAGE, 4 * PAGE)
        assert capped.available_size() == 4 * PAGE
        out = capped.alloc(4 * PAGE)
        assert out is not None and capped.alloc(PAGE) is None, "the cap must hold"
        capped.free(out)
        assert capped.check_integrity() == []
    finally:
        capped_source.close()


def test_a_starved_check_says_no_at_once(setup: tuple) -> None:
    """The allocator never waits inside SGLang's scheduler loop (STYLE habit 13): a lone
    request starved by a neighbour gets False at once; holding it is the hook's policy."""
    allocator, source, neighbour, _ = setup
    grabbed = neighbour.alloc(neighbour.available_blocks())
    for requests in ([object()], [object(), object()]):
        start = time.monotonic()
        fits = allocator.check_decode_capacity(num_tokens=PAGE, tree_cache=None,
                                               requests=requests)
        elapsed = time.monotonic() - start
        assert not fits, "the arena is full: the check must fail"
        assert elapsed < 0.1, f"a starved check must answer at once, took {elapsed:.3f} s"
    assert allocator.cap_allows(PAGE), "the neighbour holds the memory, not this runtime's cap"
    freed, grabbed = grabbed[BPS:2 * BPS], grabbed[:BPS] + grabbed[2 * BPS:]
    neighbour.free(freed)  # slab 1 (slab 0 would only be parked)
    assert allocator.check_decode_capacity(num_tokens=PAGE, tree_cache=None,
                                           requests=[object()]), (
        "once the neighbour frees memory the next check (SGLang's next iteration) passes")
    out = allocator.alloc(PAGE)
    assert out is not None
    allocator.free(out)
    neighbour.free(grabbed)
    _check(allocator, source)


def test_admission_reopens_when_a_neighbour_frees_memory(setup: tuple) -> None:
    allocator, source, neighbour, _ = setup
    grabbed = neighbour.alloc(neighbour.available_blocks() - 4)
    assert not allocator.admission_reopens(False), "a clear flag stays clear"
    assert not allocator.admission_reopens(True), "flag just set: nothing freed since"
    own = allocator.alloc(2 * PAGE)  # own decoding shrinks what is available: still shut
    assert own is not None
    assert not allocator.admission_reopens(True), "less memory than when the flag was set"
    neighbour.free(grabbed[:8])
    assert allocator.admission_reopens(True), "the neighbour freed two slabs: try again"
    assert not allocator.admission_reopens(True), "the next pass set the flag again: wait"
    neighbour.free(grabbed[8:])
    assert allocator.admission_reopens(True), "more memory again: try again"
    assert not allocator.admission_reopens(False)
    allocator.free(own)
    _check(allocator, source)


def test_triton_page_kernels_only_for_power_of_two_pages() -> None:
    # SGLang's alloc_extend/alloc_decode Triton kernels take tl.arange(0, page_size): a page
    # of 20 or 48 tokens (key-sharing plans) must take the torch path instead.
    assert [triton_pages_ok(p) for p in (1, 16, 64)] == [True] * 3
    assert [triton_pages_ok(p) for p in (20, 40, 48)] == [False] * 3


def test_padding_slab_is_parked_whoever_draws_it() -> None:
    """SGLang writes padded tokens to slot 0 of every format's view: byte 0 of the arena. A
    page-1 format (blocks of one token) holding slab 0 would have its block 1 overwritten by a
    neighbour whose token stride is larger, if only page 0 were parked; with the whole slab 0
    parked no format's padded write reaches anyone's KV. Drawn in one go, not a block a draw.

        slab 0: [p p p ... p]  (64 one-token blocks of "w", all parked)   slab 1..: KV
    """
    arena = ScratchArena.create(SLAB_BYTES, NUM_SLABS, 64)
    wide = fit_format(SHAPE, SLAB_BYTES, [1])
    assert wide is not None and wide.blocks_per_slab(SLAB_BYTES) == 64
    source = arena.arena.client("w", wide)
    try:
        allocator = slab_allocator(arena, source, wide, 1, (NUM_SLABS - 1) * 64)
        out = allocator.alloc(3)
        assert out is not None and int(out.min()) >= 64, "KV never lands in slab 0"
        assert source.num_used_blocks() == 64 + 3, "all of slab 0 parked, plus the 3 slots"
        assert allocator.check_integrity() == []
        allocator.free(out)
        assert source.num_used_blocks() == 64, "freeing KV leaves the padding slab parked"
        allocator.clear()
        assert source.num_used_blocks() == 0, "clear (SGLang's flush) gives everything back"
    finally:
        source.close()
        arena.close()


def test_a_neighbour_holding_slab_0_leaves_this_runtime_nothing_to_park(setup: tuple) -> None:
    allocator, source, neighbour, _ = setup
    padding = neighbour.alloc(BPS)  # the neighbour (another runtime) drew slab 0
    assert max(padding) < BPS
    out = allocator.alloc(2 * PAGE)
    assert out is not None and int((out // PAGE).min()) >= BPS
    assert source.num_used_blocks() == 2, "nothing parked: slab 0 is the neighbour's"
    allocator.free(out)
    neighbour.free(padding)
    _check(allocator, source)


def test_available_size_leaves_out_a_free_padding_slab_so_an_admitted_prefill_fits(
        setup: tuple) -> None:
    """Counted while free, slab 0 promised SGLang one slab that the first draw then parks: a
    prefill admitted on the promise ran out of memory and killed the runtime (the streaming
    fleet, once weights stopped taking slab 0). Every page promised is a page allocated."""
    allocator, source, neighbour, _ = setup
    held = neighbour.alloc(3 * BPS)  # slabs 0-2; then slab 0 goes back: the arena binds
    neighbour.free(sorted(held)[:BPS])
    free_slabs = NUM_SLABS - 2  # slab 0 and slabs 3..7
    assert allocator.available_size() == (free_slabs - 1) * BPS * PAGE, "slab 0 is not room"
    everything = allocator.alloc(allocator.available_size())
    assert everything is not None, "the whole promise is allocatable"
    assert allocator.available_size() == 0
    allocator.free(everything)
    allocator.clear()
    padding = neighbour.alloc(BPS)  # the neighbour holds slab 0 again: nothing to leave out
    assert max(padding) < BPS and allocator.available_size() == (free_slabs - 1) * BPS * PAGE
    neighbour.free(padding + sorted(held)[BPS:])
    _check(allocator, source)


def test_pages_are_zeroed_as_sglang_gets_them_where_asked(setup: tuple) -> None:
    """On CUDA (`needs_zeroed_pages`) a page may hold another format's stale bytes, NaN in this
    one; it is zeroed as SGLang gets it. Shown on CPU with the zeroing forced on."""
    _, _, _, arena = setup
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None
    rows = arena.arena.tensor().view(-1, fmt.block_stride_bytes)  # type: ignore[attr-defined]
    rows.fill_(0xFF)  # bf16 0xFFFF is NaN: what a previous tenant may have left
    source = arena.arena.client("z", fmt)
    try:
        zeroing = slab_allocator(arena, source, fmt, PAGE, 8 * PAGE, page_bytes=rows)
        out = zeroing.alloc(3 * PAGE)
        assert out is not None
        pages = (out // PAGE).unique()
        assert not bool(rows[pages].any()), "every page SGLang gets reads as zeros"
        assert bool((rows[0] == 0xFF).all()), "parked padding pages are not SGLang's: untouched"
        zeroing.free(out)
    finally:
        source.close()
    assert needs_zeroed_pages("cuda:0") and not needs_zeroed_pages("cpu"), (
        "zeroed on GPUs, whose kernels may read a page's unwritten tail; not on CPU, where "
        "torch_native gathers only written slots")


class _EvictingCache:
    """What SGLang's eviction does to the allocator: its cached pages are freed through it."""

    def __init__(self, allocator: SlabAllocator, cached: torch.Tensor) -> None:
        self.allocator, self.cached = allocator, cached

    def supports_prefix_sharing(self) -> bool:
        return True

    def evict_for_alloc(self, params: object) -> None:
        pages, self.cached = self.cached, self.cached[:0]
        if pages.numel():
            self.allocator.free(pages)

    # What SGLang's prefill budget asks of it.
    def supports_mamba(self) -> bool:
        return False

    def evictable_size(self) -> int:
        return int(self.cached.numel())


def test_pages_an_eviction_frees_for_an_allocation_are_not_lost_to_a_neighbour(
        setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by the long fuzz run (issue #15): SGLang evicts its prefix cache right before
    # alloc_extend; the freed pages went back to the arena and a neighbour's prefill took them
    # in between, so the alloc failed ("Prefill out of memory") and the runtime died. Here the
    # neighbour takes whatever the arena has the moment anything is given back to it.
    allocator, source, neighbour, _ = setup
    cached = allocator.alloc(2 * BPS * PAGE)  # two slabs of this runtime's cached prefixes
    assert cached is not None
    grabbed = neighbour.alloc(neighbour.available_blocks())  # the rest of the arena
    real_free = source.free

    def free_then_neighbour_grabs(block_ids: list[int]) -> None:
        real_free(block_ids)
        grabbed.extend(neighbour.alloc(neighbour.available_blocks()))

    monkeypatch.setattr(source, "free", free_then_neighbour_grabs)
    cache = _EvictingCache(allocator, cached)  # token locations, as SGLang frees them
    allocator.evict_to_free_tokens(cache, BPS * PAGE)
    out = allocator.alloc(BPS * PAGE)
    assert out is not None, "the evicted pages must serve the allocation they were evicted for"
    monkeypatch.setattr(source, "free", real_free)
    allocator.free(out)
    neighbour.free(grabbed)
    _check(allocator, source)


def _one_slab(blocks: list[int]) -> list[int]:
    """The blocks of one whole slab among `blocks`."""
    slab = min(blocks) // BPS
    return [b for b in blocks if b // BPS == slab]


def test_an_eviction_for_an_allocation_counts_only_the_pages_in_hand(
        setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by the live capacity benchmark (2026-11-29, "Prefill out of memory", the runtime
    # died with its requests): the admission saw room, a neighbour took it before the draw,
    # gave a slab back, and took it again at the next draw. The last-resort eviction asked
    # SGLang to evict the shortfall against available_size, which counted that free slab, so
    # it evicted nothing and the draw failed. It must count only the pages in hand.
    allocator, source, neighbour, _ = setup
    cached = allocator.alloc(2 * BPS * PAGE)  # two slabs of this runtime's cached prefixes
    assert cached is not None
    cache = _EvictingCache(allocator, cached)
    allocator.evict_to_free_tokens(cache, PAGE)  # SGLang hands over its cache (fits: no-op)
    grabbed = neighbour.alloc(neighbour.available_blocks())  # the rest of the arena
    real_alloc, draws = source.alloc, []

    def neighbour_first(num_blocks: int) -> list[int]:
        draws.append(num_blocks)
        grabbed.extend(neighbour.alloc(neighbour.available_blocks()))  # whatever is free
        try:
            return real_alloc(num_blocks)
        finally:
            if len(draws) == 1:  # then a request of the neighbour's ends: a slab free again
                freed = _one_slab(grabbed)
                neighbour.free(freed)
                for block in freed:
                    grabbed.remove(block)

    monkeypatch.setattr(source, "alloc", neighbour_first)
    out = allocator.alloc(BPS * PAGE)
    assert out is not None, "the runtime's own cache covers it: the allocation must not fail"
    assert set((out // PAGE).tolist()) <= set((cached // PAGE).tolist()), "from its own cache"
    monkeypatch.setattr(source, "alloc", real_alloc)
    allocator.free(out)
    neighbour.free(grabbed)
    _check(allocator, source)


def test_a_short_allocation_waits_for_a_neighbour_to_give_pages_back(
        setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of its own to evict and the neighbour holds the arena: the allocation waits
    (up to STARVED_WAIT_S) instead of failing, which SGLang treats as fatal."""
    import threading

    from fineslab.sglang_plugin import allocator as module

    allocator, source, neighbour, _ = setup
    monkeypatch.setattr(module, "STARVED_WAIT_S", 10.0)
    grabbed = neighbour.alloc(neighbour.available_blocks())
    freed = _one_slab([b for b in grabbed if b >= BPS])  # not the padding slab
    timer = threading.Timer(0.3, neighbour.free, args=(freed,))
    start = time.monotonic()
    timer.start()
    out = allocator.alloc(BPS * PAGE)
    waited = time.monotonic() - start
    timer.join()
    assert out is not None and waited >= 0.25, (out, waited)
    allocator.free(out)
    neighbour.free([b for b in grabbed if b not in freed])
    _check(allocator, source)


def test_an_allocation_past_the_kv_limit_fails_at_once(
        setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting frees nothing past the runtime's own limit: no wait there."""
    from fineslab.sglang_plugin import allocator as module

    allocator, source, _, arena = setup
    monkeypatch.setattr(module, "STARVED_WAIT_S", 10.0)
    arena.arena.table.set_kv_limit("m", SLAB_BYTES)
    held = allocator.alloc(BPS * PAGE)
    assert held is not None
    start = time.monotonic()
    assert allocator.alloc(PAGE) is None
    assert time.monotonic() - start < 1.0, "no wait for memory nothing would free"
    arena.arena.table.set_kv_limit("m", None)
    allocator.free(held)
    _check(allocator, source)


def test_an_allocation_that_fits_draws_nothing_before_it(
        setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLang calls evict_to_free_tokens before every decode step with a page per request,
    # whether or not the step opens a page. When that fits, nothing may be drawn from the shared
    # table ahead of the allocation (a first version of the fix above reserved, and gave back,
    # a page every step).
    allocator, source, _, _ = setup
    held = allocator.alloc(2 * PAGE)
    assert held is not None
    drawn: list[int] = []
    real_alloc = source.alloc

    def counting_alloc(num_blocks: int) -> list[int]:
        drawn.append(num_blocks)
        return real_alloc(num_blocks)

    monkeypatch.setattr(source, "alloc", counting_alloc)
    cache = _EvictingCache(allocator, held[:0])
    allocator.evict_to_free_tokens(cache, 3 * PAGE)
    assert drawn == [], f"an allocation that fits drew {drawn} blocks before it ran"
    monkeypatch.setattr(source, "alloc", real_alloc)
    allocator.free(held)
    _check(allocator, source)


def test_a_kv_limit_is_this_runtimes_own_cap_so_a_lone_request_over_it_is_not_held(
        setup: tuple) -> None:
    """`fineslab ctl limit`: SGLang sees the limit as a smaller pool, and the starvation hold
    (which waits for neighbours to give memory back) must not wait for it: nothing frees it."""
    allocator, source, neighbour, arena = setup
    arena.arena.table.set_kv_limit("m", 2 * SLAB_BYTES)  # 2 of KV; the parked padding slab on top
    assert allocator.available_size() <= 2 * BPS * PAGE
    out = allocator.alloc(2 * BPS * PAGE)
    assert out is not None, "within the limit an allocation succeeds"
    assert allocator.alloc(PAGE) is None, "beyond the limit it fails cleanly"
    assert not allocator.cap_allows(PAGE), "over the limit: the runtime's own cap, not starvation"
    assert len(neighbour.alloc(BPS)) == BPS, "the neighbour still finds free slabs"
    arena.arena.table.set_kv_limit("m", None)
    assert allocator.cap_allows(PAGE), "with the limit lifted, only capacity counts"
    allocator.free(out)
    _check(allocator, source)


def test_an_idle_runtime_gives_back_a_reserve_no_allocation_took(setup: tuple) -> None:
    """SGLang calls verify_byte_accounting only when its scheduler is fully idle; a reserve
    (a prefill budget's or a decode check's) that no allocation took is then memory no
    neighbour could get (CI: a neighbour could not admit two requests that fit the rest)."""
    allocator, source, neighbour, _ = setup
    assert allocator.check_decode_capacity(num_tokens=2 * BPS * PAGE, tree_cache=None)
    held = source.num_used_blocks()
    assert held >= 2 * BPS, "the check reserved two slabs' pages in the table"
    others = neighbour.available_blocks()
    assert allocator.verify_byte_accounting() == []
    assert source.num_used_blocks() <= BPS, "only the parked padding slab stays held"
    assert neighbour.available_blocks() >= others + 2 * BPS, "the neighbour can take them"
    assert allocator.used_tokens() == 0
    _check(allocator, source)


def test_an_idle_key_pool_runtime_gives_back_its_block_cache(setup: tuple) -> None:
    """A key-pool source (PooledSlabs) keeps up to a slab of blocks in its cache, counted as
    its own for the neighbours; the idle check gives them back with the reserve."""
    _, _, _, arena = setup
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None
    pooled = arena.arena.client("k", fmt, pooled=True)
    mate = arena.arena.client("k2", fmt, pooled=True)
    try:
        allocator = slab_allocator(arena, pooled, fmt, PAGE, (NUM_SLABS - 1) * BPS * PAGE)
        out = allocator.alloc(2 * PAGE)
        assert out is not None
        allocator.free(out)
        assert pooled.num_cached_blocks() > 0, "the freed pages wait in the source's cache"
        others = mate.available_blocks()
        assert allocator.verify_byte_accounting() == []
        assert pooled.num_cached_blocks() == 0, "idle: the cache went back to the pool"
        assert mate.available_blocks() > others, "the neighbour can take them"
        assert pooled.num_used_blocks() <= BPS, "only the parked padding slab stays held"
        assert allocator.check_integrity() == []
        pooled.check_integrity()
    finally:
        mate.close()
        pooled.close()


# SGLang admits a prefill on the memory it counts (the arena's free slabs included) and allocates
# it later in the step. Two rehearsals of the suite lost a runtime to a neighbour that carved a
# slab in between ("Prefill out of memory": a waking model's weights, a test's hog). Every
# admission path now holds its pages; each test below has SGLang's own budget as the control.

def _admit(budget: PrefillBudget, tokens: int) -> bool:
    """One admission check as SGLang's `add_one_req` makes it (no max_new_tokens: all of
    `tokens` are this step's prefill)."""
    fits, _ = budget.check_prefill(extend_input_len=tokens, total_tokens=tokens,
                                   max_new_tokens=0, input_tokens=tokens,
                                   swa_host_hit_length=0, chunk_limit=None)
    if fits:
        budget.reserve(tokens, 0)  # what SGLang's _update_prefill_budget does on admission
    return fits


def _budget(budget_class: str, allocator: SlabAllocator, cache: _EvictingCache
            ) -> PrefillBudget:
    """The slab budget, or SGLang's own (the control), over `allocator` and `cache`."""
    return (allocator.create_prefill_budget(cache) if budget_class == "slab"
            else PrefillBudget(allocator, cache))


def _extend(allocator: SlabAllocator, cache: _EvictingCache, *lengths: int
            ) -> torch.Tensor | None:
    """SGLang's `alloc_for_extend` for a batch of new requests: evict, allocate."""
    n, total = len(lengths), sum(lengths)
    seq = torch.tensor(lengths)
    allocator.evict_to_free_tokens(cache, total + n * PAGE)
    none = torch.zeros(n, dtype=torch.int64)
    return allocator.alloc_extend(none, none, seq, seq, torch.full((n,), -1), total)


@pytest.mark.parametrize("budget_class", ["slab", "sglang"])
def test_an_admitted_prefill_is_allocated_though_a_neighbour_takes_the_free_slabs(
        setup: tuple, budget_class: str) -> None:
    allocator, source, neighbour, _ = setup
    cache = _EvictingCache(allocator, torch.zeros(0, dtype=torch.int64))
    budget = _budget(budget_class, allocator, cache)
    for _ in range(2):  # two requests of one slab each in the step
        assert _admit(budget, BPS * PAGE - PAGE), "the arena has room for both"
    grabbed = neighbour.alloc(neighbour.available_blocks())  # the neighbour takes the rest
    out = _extend(allocator, cache, BPS * PAGE - PAGE, BPS * PAGE - PAGE)
    if budget_class == "sglang":
        assert out is None, "control: SGLang's own budget held nothing"
    else:
        assert out is not None, "an admitted prefill must be allocated"
        allocator.free(out)
    neighbour.free(grabbed)
    allocator.release_reserve()
    _check(allocator, source)


@pytest.mark.parametrize("budget_class", ["slab", "sglang"])
def test_a_chunk_goes_ahead_only_with_memory_held_and_waits_without(
        setup: tuple, budget_class: str) -> None:
    allocator, source, neighbour, _ = setup
    cache = _EvictingCache(allocator, torch.zeros(0, dtype=torch.int64))
    chunk = 2 * BPS * PAGE
    grabbed = neighbour.alloc(neighbour.available_blocks())
    budget = _budget(budget_class, allocator, cache)
    tokens = budget.available_chunk_tokens(chunk)
    if budget_class == "sglang":
        # SGLang's single pool lets a chunk go ahead with nothing left: here that allocation
        # would fail and kill the runtime.
        assert tokens == chunk and _extend(allocator, cache, tokens) is None
    else:
        assert tokens is None, "with the arena full the chunk waits a step"
        neighbour.free(grabbed[BPS:2 * BPS])  # one slab comes free
        tokens = allocator.create_prefill_budget(cache).available_chunk_tokens(chunk)
        assert tokens is not None and 0 < tokens < chunk, f"a smaller chunk, held: {tokens}"
        grabbed = grabbed[:BPS] + grabbed[2 * BPS:] + neighbour.alloc(
            neighbour.available_blocks())  # the neighbour takes whatever it can
        out = _extend(allocator, cache, tokens)
        assert out is not None, "the held chunk is allocated"
        allocator.free(out)
    neighbour.free(grabbed)
    allocator.release_reserve()
    _check(allocator, source)


def test_an_allocation_evicts_its_own_cache_when_a_neighbour_took_the_free_slabs(
        setup: tuple) -> None:
    # The admission holds only what the prefix cache cannot free; SGLang's eviction right
    # before the allocation evicts nothing while free slabs cover it. A neighbour taking those
    # slabs in between leaves the allocation its own cache to evict.
    allocator, source, neighbour, _ = setup
    cached = allocator.alloc(BPS * PAGE)  # one slab of this runtime's cached prefixes
    assert cached is not None
    cache = _EvictingCache(allocator, cached)
    assert _admit(allocator.create_prefill_budget(cache), BPS * PAGE - PAGE)
    assert allocator.available_size() > BPS * PAGE, "the free slabs cover the allocation"
    allocator.evict_to_free_tokens(cache, BPS * PAGE)
    assert cache.cached.numel() == BPS * PAGE, "it fits: SGLang's check evicts nothing"
    grabbed = neighbour.alloc(neighbour.available_blocks())
    length = torch.tensor([BPS * PAGE - PAGE])
    out = allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), length, length,
                                 torch.tensor([-1]), BPS * PAGE - PAGE)
    assert out is not None, "the allocation falls back on its own prefix cache"
    assert cache.cached.numel() == 0, "the cache was evicted for it"
    allocator.free(out)
    neighbour.free(grabbed)
    _check(allocator, source)


@pytest.mark.parametrize("budget_class", ["slab", "sglang"])
def test_a_prefill_that_fills_the_capacity_to_its_last_page_is_admitted(
        setup: tuple, budget_class: str) -> None:
    # --max-total-tokens 1024 with page 16: a 1,010-token prompt (64 pages, the whole capacity)
    # was never admitted by the slab budget, which held one page past the capacity for it, and
    # its request hung for ever. SGLang's own budget (the control) admits it.
    allocator, source, _, _ = setup
    cache = _EvictingCache(allocator, torch.zeros(0, dtype=torch.int64))
    budget = _budget(budget_class, allocator, cache)
    capacity = allocator.room_tokens()
    assert capacity == (NUM_SLABS - 1) * BPS * PAGE
    tokens = capacity - PAGE // 2
    assert _admit(budget, tokens), "SGLang admits a prefill its capacity holds"
    out = _extend(allocator, cache, tokens)
    assert out is not None and out.numel() == tokens
    assert allocator.room_tokens() == 0
    allocator.free(out)
    allocator.release_reserve()
    _check(allocator, source)

"""SlabAllocator over a real slab table: SGLang's allocator interface, page by page.

No SGLang runtime here: SGLang's own allocator base class and the plugin's pool, on a CPU arena
created by the test, with a second runtime in the same table playing the neighbour.

    arena: 8 slabs x 4 blocks (16 tokens each) = 32 pages of "m"; page 0 is parked
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from plugin_test_support import ScratchArena

from fineslab.sglang_plugin import allocator as allocator_module
from fineslab.sglang_plugin.allocator import PADDING_PAGE, SlabAllocator, triton_pages_ok
from fineslab.sglang_plugin.pool import SlabKVPool
from fineslab.slabs import KVDtype, KVShape, RuntimeSlabs
from fineslab.slabs.sizing import fit_format
from fineslab.slabs.views import layer_views

PAGE = 16
SHAPE = KVShape("m", 2, 2, 64, KVDtype.BF16)  # 1,024 B a token, 16 KiB a block
SLAB_BYTES = 64 << 10
NUM_SLABS = 8


@pytest.fixture
def setup() -> Iterator[tuple[SlabAllocator, RuntimeSlabs, RuntimeSlabs, ScratchArena]]:
    arena = ScratchArena.create(SLAB_BYTES, NUM_SLABS, 4)
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None and fmt.blocks_per_slab(SLAB_BYTES) == 4
    source = arena.arena.client("m", fmt)
    neighbour = arena.arena.client("n", fmt)
    size = NUM_SLABS * 4 * PAGE - PAGE
    pool = SlabKVPool.over(layer_views(arena.arena.tensor(), fmt))(  # type: ignore[arg-type]
        size, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=2,
        device="cpu", enable_memory_saver=False)
    allocator = SlabAllocator(size, PAGE, torch.bfloat16, "cpu", pool, False, source=source)
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
            assert PADDING_PAGE not in pages.tolist(), "page 0 is never handed to SGLang"
            live.append(out)
        _check(allocator, source)
    for out in live:
        allocator.free(out)
    _check(allocator, source)
    assert allocator.used_tokens() == 0
    assert source.num_used_blocks() <= 1, "only the parked page 0 may stay held"


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
    assert used.get("n", 0) == 0 and used.get("m", 0) <= 16 * 1024, (
        f"freed pages must go back to the free space at once: {used}")
    _check(allocator, source)


def test_checked_capacity_survives_a_neighbour_grabbing_the_rest(setup: tuple) -> None:
    allocator, source, neighbour, _ = setup
    assert allocator.check_decode_capacity(num_tokens=3 * PAGE, tree_cache=None)
    grabbed = neighbour.alloc(neighbour.available_blocks())  # everything still free
    assert allocator.available_size() == 3 * PAGE, "what the check reserved stays available"
    out = allocator.alloc(3 * PAGE)
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
        pool = SlabKVPool.over(layer_views(arena.arena.tensor(), fmt))(
            4 * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64,
            layer_num=2, device="cpu", enable_memory_saver=False)
        capped = SlabAllocator(4 * PAGE, PAGE, torch.bfloat16, "cpu", pool, False,
                               source=capped_source)
        assert capped.available_size() == 4 * PAGE
        out = capped.alloc(4 * PAGE)
        assert out is not None and capped.alloc(PAGE) is None, "the cap must hold"
        capped.free(out)
        assert capped.check_integrity() == []
    finally:
        capped_source.close()


def test_last_request_waits_for_a_neighbour_to_free_memory(setup: tuple) -> None:
    allocator, source, neighbour, _ = setup
    grabbed = neighbour.alloc(neighbour.available_blocks())
    one_request = [object()]
    assert not allocator.check_decode_capacity(num_tokens=PAGE, tree_cache=None,
                                               requests=[object(), object()]), (
        "with several requests running, a short arena means retraction, not a wait")
    timer = threading.Timer(0.3, neighbour.free, args=(grabbed[:4],))
    timer.start()
    start = time.monotonic()
    assert allocator.check_decode_capacity(num_tokens=PAGE, tree_cache=None,
                                           requests=one_request), (
        "the last request must get the page its neighbour frees, not be aborted")
    assert time.monotonic() - start >= 0.25, "it had to wait for the neighbour"
    timer.join()
    out = allocator.alloc(PAGE)
    assert out is not None
    allocator.free(out)
    neighbour.free(grabbed[4:])
    _check(allocator, source)


def test_last_request_gives_up_after_the_wait(setup: tuple,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    allocator, source, neighbour, _ = setup
    monkeypatch.setattr(allocator_module, "STARVED_WAIT_S", 0.2)
    grabbed = neighbour.alloc(neighbour.available_blocks())
    start = time.monotonic()
    assert not allocator.check_decode_capacity(num_tokens=PAGE, tree_cache=None,
                                               requests=[object()])
    assert 0.2 <= time.monotonic() - start < 5, "the wait is bounded by STARVED_WAIT_S"
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

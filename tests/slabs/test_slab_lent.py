"""Lent slabs (SwiftCache, issue #20): a borrower's evicted pages in free slabs of the arena.

Arena of these tests: NUM_SLABS = 6 slabs of 4 KiB; FMT_A has 8 blocks (pages) of 512 B a slab.
Pages are rows of the arena viewed as [48, 512] bytes (row p = block id p). Every test checks the
table's invariants (T7: a lent slab is FREE and lent to an active runtime) after mutating.
"""

from __future__ import annotations

import time

import pytest
import torch
from slab_constants import FMT_A, NUM_SLABS, SLAB_BYTES, dead_pid

from fineslab.errors import ArenaExhausted
from fineslab.slabs.arena import SlabArena
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.lent import LentPages, lent_slabs, set_lend_cap
from fineslab.slabs.table import SlabState

BPS = SLAB_BYTES // FMT_A.block_stride_bytes  # 8


def pages_of(arena: SlabArena) -> torch.Tensor:
    flat = arena.tensor()
    assert isinstance(flat, torch.Tensor)
    return flat.view(NUM_SLABS * BPS, FMT_A.block_stride_bytes)


def borrower(arena: SlabArena, cap: int) -> tuple[list[int], LentPages]:
    """A runtime with 8 pages of its own, filled with distinct bytes, and its lent tier."""
    rt = arena.client("borrower", FMT_A)
    own = rt.alloc(BPS)
    pages = pages_of(arena)
    for k, page in enumerate(own):
        pages[page] = k + 1
    assert set_lend_cap(arena.table, "borrower", cap)
    return own, LentPages(arena.table, rt.slot, pages, BPS)


def hashes(n: int, tag: str = "p") -> list[bytes]:
    return [f"{tag}{k}".encode() for k in range(n)]


def test_stored_pages_come_back_byte_for_byte_into_other_pages(arena: SlabArena) -> None:
    own, lent = borrower(arena, cap=2)
    pages = pages_of(arena)
    expected = pages[own[:5]].clone()
    assert lent.store(hashes(5), own[:5]) == 5
    pages[own[:5]] = 0  # the borrower reuses its pages (eviction freed them)
    assert lent.lookup(hashes(5)) == 5
    assert lent.lookup([b"p0", b"p1", b"nope", b"p3"]) == 2, "a hit is a run from the first"
    assert lent.load(hashes(5), own[3:8])
    assert torch.equal(pages[own[3:8]], expected)
    assert lent_slabs(arena.table) == {"borrower": 1}
    assert snapshot(arena.table).free_slabs == NUM_SLABS - 1, "a lent slab still counts free"
    check_integrity(arena.table)


def test_a_lenders_carve_takes_a_lent_slab_at_once_and_the_pages_read_as_gone(
        arena: SlabArena) -> None:
    own, lent = borrower(arena, cap=NUM_SLABS)
    assert lent.store(hashes(4 * BPS), (own * 4)[: 4 * BPS]) == 4 * BPS  # 4 slabs lent
    lender = arena.client("lender", FMT_A)
    assert lender.available_blocks() == (NUM_SLABS - 1) * BPS, "lent slabs count as free"
    got = lender.alloc((NUM_SLABS - 1) * BPS)  # every slab but the borrower's own: no error
    assert len(got) == (NUM_SLABS - 1) * BPS
    assert lent_slabs(arena.table) == {}
    assert lent.lookup(hashes(4 * BPS)) == 0
    assert not lent.load(hashes(1), own[:1]), "a taken page never loads"
    check_integrity(arena.table)


def test_a_carve_takes_unlent_free_slabs_before_lent_ones(arena: SlabArena) -> None:
    own, lent = borrower(arena, cap=1)  # its own pages: slab 0
    lender = arena.client("lender", FMT_A)
    held = lender.alloc((NUM_SLABS - 1) * BPS)  # slabs 1..5
    lender.free([b for b in held if b // BPS == 2])
    assert lent.store(hashes(BPS), own) == BPS
    assert lent_slabs(arena.table) == {"borrower": 1} and arena.table.lent_to[2] != 0
    lender.free([b for b in held if b // BPS == 4])  # slab 4 free and unlent, above slab 2
    again = lender.alloc(BPS)
    assert {b // BPS for b in again} == {4}, "the unlent slab went first"
    assert lent.lookup(hashes(BPS)) == BPS
    lender.alloc(BPS)
    assert lent.lookup(hashes(BPS)) == 0, "then the lent one, at once"
    check_integrity(arena.table)


def test_the_cap_bounds_held_slabs_and_the_tier_recycles_its_oldest_pages(
        arena: SlabArena) -> None:
    own, lent = borrower(arena, cap=1)
    assert lent.store(hashes(BPS, "a"), own) == BPS
    assert lent.store(hashes(2, "b"), own[:2]) == 2, "the two oldest pages make room"
    assert lent.held_slabs() == 1
    assert lent.lookup(hashes(2, "a")) == 0 and lent.lookup(hashes(BPS, "a")[2:]) == BPS - 2
    assert lent.lookup(hashes(2, "b")) == 2
    set_lend_cap(arena.table, "borrower", 0)
    assert lent.store(hashes(1, "c"), own[:1]) == 0, "cap 0: nothing is lent"
    assert lent.held_slabs() == 0 and lent_slabs(arena.table) == {}
    assert lent.stats.refused_pages == 1
    check_integrity(arena.table)


def test_a_dead_borrowers_lent_marks_are_cleared_with_its_slot(arena: SlabArena) -> None:
    own, lent = borrower(arena, cap=2)
    lent.store(hashes(BPS), own)
    slot = lent.slot
    arena.table.rt_pid[slot] = dead_pid()
    assert arena.table.reclaim_dead_owners() == ["borrower"]
    assert lent_slabs(arena.table) == {} and not arena.table.lent_to.any()
    assert int(arena.table.rt_lend_cap[slot]) == 0
    assert (arena.table.state == SlabState.FREE).all()
    check_integrity(arena.table)


def test_release_gives_every_lent_slab_back(arena: SlabArena) -> None:
    own, lent = borrower(arena, cap=3)
    lent.store(hashes(3 * BPS), (own * 3))
    assert lent_slabs(arena.table) == {"borrower": 3}
    lent.release()
    assert lent_slabs(arena.table) == {} and lent.lookup(hashes(1)) == 0
    check_integrity(arena.table)


def test_a_slab_taken_between_the_plan_and_the_copy_is_never_written(arena: SlabArena) -> None:
    """The race the per-slab lock holds close: a lender carves a lent slab after the borrower
    planned its pages there and writes its own KV; the borrower's copy must skip that slab."""
    own, plain = borrower(arena, cap=1)
    lender = arena.client("lender", FMT_A)
    pages = pages_of(arena)

    class Raced(LentPages):
        def _place(self, count: int) -> list[tuple[int, int]]:
            placed = super()._place(count)
            taken = lender.alloc(lender.available_blocks())  # every free slab, the lent one too
            pages[taken] = 0xAB  # the lender's own KV
            self.lender_blocks = taken
            return placed

    raced = Raced(arena.table, plain.slot, pages, BPS)
    assert raced.store(hashes(BPS), own) == 0, "nothing was lent: the slab was taken"
    assert bool((pages[raced.lender_blocks] == 0xAB).all()), "the lender's bytes are intact"
    assert raced.lookup(hashes(1)) == 0
    check_integrity(arena.table)


def _busy_lent_slab(arena: SlabArena, slot: int, slab: int) -> None:
    """What a borrower's store does before its copy: slab `slab` lent to `slot`, busy."""
    with arena.table.lock():
        arena.table.lent_to[slab] = slot + 1
        arena.table.lent_busy[slab] = 1


def test_a_carve_needing_a_slab_under_copy_waits_for_the_copy_and_no_longer(
        arena: SlabArena) -> None:
    import threading

    _, plain = borrower(arena, cap=2)  # its own pages: slab 0
    _busy_lent_slab(arena, plain.slot, 5)
    lender = arena.client("lender", FMT_A)
    first = lender.alloc((NUM_SLABS - 2) * BPS)  # slabs 1..4: no wait, the busy one is last
    assert {b // BPS for b in first} == {1, 2, 3, 4}
    done: list[float] = []

    def carve_the_busy_one() -> None:
        started = time.perf_counter()
        lender.alloc(BPS)
        done.append(time.perf_counter() - started)

    thread = threading.Thread(target=carve_the_busy_one)
    thread.start()
    time.sleep(0.2)
    assert not done, "the carve waits while the copy runs"
    arena.table.lent_busy[5] = 0  # the borrower's copy ends (it lowers the flag, no lock)
    thread.join(5)
    assert done and done[0] >= 0.2
    assert arena.table.lent_to[5] == 0, "taken, its pages dropped"
    check_integrity(arena.table)


def test_a_borrower_stopped_mid_copy_fails_the_carve_and_a_dead_one_does_not(
        arena: SlabArena, monkeypatch: pytest.MonkeyPatch) -> None:
    from fineslab.slabs import table as table_module

    monkeypatch.setattr(table_module, "BUSY_WAIT_S", 0.1)
    _, plain = borrower(arena, cap=2)
    lender = arena.client("lender", FMT_A)
    lender.alloc((NUM_SLABS - 2) * BPS)
    _busy_lent_slab(arena, plain.slot, 5)
    before = arena.table.raw()
    with pytest.raises(ArenaExhausted, match="still being copied into"):
        lender.alloc(BPS)
    assert arena.table.raw() == before, "a failed carve changes nothing"
    arena.table.rt_pid[plain.slot] = dead_pid()  # now the borrower is gone mid-copy
    assert len(lender.alloc(BPS)) == BPS
    check_integrity(arena.table, exact_owners=[lender.slot])

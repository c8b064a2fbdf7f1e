"""WeightRegion (issue #16): a runtime's weights in whole arena slabs at a fixed address.

Real shared memory, real mmap: bytes written through the region land in the arena at the slabs
the table says, the region survives unback/back onto other slabs at the same address, and the
table shows the weights as an owner of their own.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from slab_constants import FMT_A

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.shm import huge_setting_of, shm_huge_pages
from fineslab.slabs.table import SlabState
from fineslab.slabs.weights import HUGE_PAGE_BYTES, WeightRegion, free_weight_slabs

SLAB = 16 * 1024
SLABS = 8


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[SlabArena]:
    spec = ArenaSpec("w", "cpu0", SLABS * SLAB, SLAB, 32, max_runtimes=8)
    with SlabArena.create(spec, shm_dir=tmp_path) as created:
        yield created


def _arena_bytes(arena: SlabArena, slab: int) -> torch.Tensor:
    return arena.tensor()[slab * SLAB:(slab + 1) * SLAB]  # type: ignore[index]


def test_weights_written_through_the_region_live_in_the_arena_slabs(arena: SlabArena) -> None:
    region = WeightRegion(arena.table, arena.paths.data, "m-r0", 2 * SLAB + 100)
    slabs = region.back()
    assert slabs.size == 3 and region.num_slabs == 3
    view = region.tensor()
    assert view.numel() == 2 * SLAB + 100
    view.copy_(torch.arange(view.numel()) % 251)
    for i, slab in enumerate(slabs.tolist()):
        got = _arena_bytes(arena, slab)[: min(SLAB, view.numel() - i * SLAB)]
        assert torch.equal(got, view[i * SLAB: i * SLAB + got.numel()]), f"slab {slab}"
    owners = {o.runtime_id: o for o in snapshot(arena.table).owners}
    assert owners["m-r0:w"].num_slabs == 3, owners
    assert all(arena.table.state[s] == SlabState.FULL for s in slabs.tolist())
    check_integrity(arena.table)
    region.close()


def test_unback_returns_the_slabs_and_back_maps_other_ones_at_the_same_address(
        arena: SlabArena) -> None:
    region = WeightRegion(arena.table, arena.paths.data, "m-r0", 2 * SLAB)
    first = region.back().copy()
    base, view = region.base, region.tensor()
    saved = (torch.arange(view.numel()) % 7).to(torch.uint8)
    view.copy_(saved)
    region.unback()
    assert not region.backed
    assert all(arena.table.state[s] == SlabState.FREE for s in first.tolist())
    # Another runtime takes slab 0 and the freed slabs: the wake must land elsewhere.
    kv = arena.client("other", FMT_A)
    kv.alloc(3 * FMT_A.blocks_per_slab(SLAB))
    second = region.back()
    assert not set(first.tolist()) & set(second.tolist()), (first, second)
    assert region.base == base, "the tensors built over the region never move"
    view.copy_(saved)  # the wake's restore, through the same tensor
    for i, slab in enumerate(second.tolist()):
        assert torch.equal(_arena_bytes(arena, slab), saved[i * SLAB:(i + 1) * SLAB])
    check_integrity(arena.table)
    region.close()
    kv.close()


def test_shrink_gives_the_tail_slabs_back_and_keeps_the_head_at_its_address(
        arena: SlabArena) -> None:
    """A region sized before a load (the CUDA path) keeps only what the load used: the slabs
    past it FREE, their range inaccessible; the head's bytes untouched; a wake takes as few."""
    region = WeightRegion(arena.table, arena.paths.data, "m-r0", 4 * SLAB)
    slabs = region.back().copy()
    head = (torch.arange(SLAB + 100) % 11).to(torch.uint8)
    region.tensor()[: head.numel()].copy_(head)
    assert region.shrink(SLAB + 100) == 2, "two whole slabs past the used bytes"
    assert region.nbytes == SLAB + 100 and region.num_slabs == 2
    assert [arena.table.state[s] for s in slabs[2:].tolist()] == [SlabState.FREE] * 2
    assert [arena.table.state[s] for s in slabs[:2].tolist()] == [SlabState.FULL] * 2
    assert torch.equal(region.tensor(), head), "the head keeps its bytes at its address"
    check_integrity(arena.table)
    region.unback()
    free = free_weight_slabs(arena.table)
    region.back()
    assert free_weight_slabs(arena.table) == free - 2, "a wake takes the shrunk count"
    with pytest.raises(ConfigError, match="cannot shrink"):
        region.shrink(SLAB + 101)
    region.close()
    check_integrity(arena.table)


def test_back_is_all_or_nothing_when_the_arena_is_short(arena: SlabArena) -> None:
    kv = arena.client("other", FMT_A)
    kv.alloc((SLABS - 2) * FMT_A.blocks_per_slab(SLAB))
    region = WeightRegion(arena.table, arena.paths.data, "m-r0", 3 * SLAB)
    free_before = int(np.count_nonzero(arena.table.state == SlabState.FREE))
    with pytest.raises(ArenaExhausted):
        region.back()
    assert not region.backed
    assert int(np.count_nonzero(arena.table.state == SlabState.FREE)) == free_before
    check_integrity(arena.table)
    region.close()
    kv.close()


def test_weights_never_take_slab_0_where_every_formats_padded_tokens_land(
        arena: SlabArena) -> None:
    """Slab 0 holds slot 0 of every format (SGLang's padded writes) and only ever holds KV. The
    failure it names: a model asleep gave slab 0 back, a KV runtime parked it whole, and the
    restart's eviction, which had made room for weights plus one slab of KV, left none
    (tests/serving/test_elastic_fleet.py's restart test, CI stop 25)."""
    region = WeightRegion(arena.table, arena.paths.data, "m-r0", (SLABS - 1) * SLAB)
    assert free_weight_slabs(arena.table) == SLABS - 1
    slabs = region.back()
    assert 0 not in slabs.tolist() and sorted(slabs.tolist()) == list(range(1, SLABS))
    assert arena.table.state[0] == SlabState.FREE and free_weight_slabs(arena.table) == 0
    region.unback()
    bigger = WeightRegion(arena.table, arena.paths.data, "m-r1", SLABS * SLAB)
    with pytest.raises(ArenaExhausted):  # every slab is free, but slab 0 is not for weights
        bigger.back()
    kv = arena.client("other", FMT_A)
    assert kv.alloc(1)[0] < FMT_A.blocks_per_slab(SLAB), "KV still draws from slab 0"
    check_integrity(arena.table)
    for owner in (region, bigger):
        owner.close()
    kv.close()


def test_a_dead_runtimes_weight_slabs_are_reclaimed(arena: SlabArena) -> None:
    region = WeightRegion(arena.table, arena.paths.data, "m-r0", SLAB)
    slab = int(region.back()[0])
    arena.table.rt_pid[region.slot] = 2 ** 22 + 12345  # no such process: the owner is dead
    assert "m-r0:w" in arena.table.reclaim_dead_owners()
    assert arena.table.state[slab] == SlabState.FREE


def test_bad_sizes_are_refused(arena: SlabArena, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="positive size"):
        WeightRegion(arena.table, arena.paths.data, "m-r0", 0)
    odd = ArenaSpec("odd", "cpu0", 4 * 6000, 6000, 8, max_runtimes=4)
    with SlabArena.create(odd, shm_dir=tmp_path) as other, \
            pytest.raises(ConfigError, match="page size"):
        WeightRegion(other.table, other.paths.data, "m-r0", 100)


# Huge pages (2 MiB): filling 512 page-table entries per slab at each wake cost as much as
# copying the weights on this machine (docs/elastic.md); where /dev/shm gives huge pages the
# region maps each 2 MiB with one.

def test_a_region_of_whole_huge_pages_starts_on_one(tmp_path: Path) -> None:
    spec = ArenaSpec("h", "cpu0", 5 * HUGE_PAGE_BYTES, HUGE_PAGE_BYTES, 1, max_runtimes=8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        regions = [WeightRegion(arena.table, arena.paths.data, f"m{i}", HUGE_PAGE_BYTES + i)
                   for i in range(3)]
        try:
            assert all(r.base % HUGE_PAGE_BYTES == 0 for r in regions), [
                hex(r.base) for r in regions]
        finally:
            for region in regions:
                region.close()


@pytest.mark.parametrize(("target", "mounts", "setting"), [
    ("/dev/shm", ["tmpfs /dev/shm tmpfs rw,relatime,size=24683656k 0 0"], "never"),
    ("/dev/shm", ["tmpfs /dev/shm tmpfs rw,size=1k,huge=advise 0 0"], "advise"),
    ("/dev/shm/x", ["/dev/root / ext4 rw 0 0", "tmpfs /dev/shm tmpfs rw,huge=within_size 0 0"],
     "within_size"),
    ("/data/x", ["tmpfs / tmpfs rw,huge=always 0 0", "/dev/sda /data xfs rw 0 0"], "n/a"),
    ("/dev/shmx", ["tmpfs /dev/shm tmpfs rw,huge=advise 0 0"], "n/a"),
])
def test_the_huge_page_setting_is_the_innermost_mounts(target: str, mounts: list[str],
                                                      setting: str) -> None:
    assert huge_setting_of(target, mounts) == setting


def _pmd_mapped_kib(start: int, end: int) -> int:
    """kB of [start, end) mapped with huge-page entries, from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = start <= int(head.group(1), 16) < end
        elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(shm_huge_pages() in ("never", "n/a"),
                    reason="/dev/shm gives no huge pages (mount -o remount,huge=advise /dev/shm)")
def test_where_shm_gives_huge_pages_a_backed_region_maps_them() -> None:
    spec = ArenaSpec(f"h{uuid.uuid4().hex[:8]}", "cpu0", 6 * HUGE_PAGE_BYTES, HUGE_PAGE_BYTES, 1,
                     max_runtimes=8)
    with SlabArena.create(spec) as arena:
        region = WeightRegion(arena.table, arena.paths.data, "m", 2 * HUGE_PAGE_BYTES)
        try:
            region.back()
            region.tensor().fill_(7)
            mapped = _pmd_mapped_kib(region.base, region.base + region.span_bytes)
            assert mapped == 2 * HUGE_PAGE_BYTES // 1024, f"{mapped} kB in huge pages"
        finally:
            region.close()

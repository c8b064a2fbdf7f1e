"""KV limits (`fineslab ctl limit`): a cap on the KV bytes one runtime id may hold in the arena.

Arena of these tests: NUM_SLABS = 6 slabs of 4 KiB; FMT_A has 8 blocks of 512 B a slab.
A limit of 2 slabs (8 KiB) lets a private runtime hold 16 blocks, a pooled one 16 blocks
wherever they sit in its key's slabs. Every test checks the table's invariants after mutating.
"""

from __future__ import annotations

import pytest
from slab_constants import FMT_A, NUM_SLABS, SLAB_BYTES

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.slabs.arena import SlabArena
from fineslab.slabs.integrity import snapshot
from fineslab.slabs.pooled import PooledSlabs

TWO_SLABS = 2 * SLAB_BYTES


def _padding_taken(arena: SlabArena) -> None:
    """A neighbour draws first and so holds slab 0, the padding slab, which a KV limit does not
    count: the tests that count slabs against a limit keep their runtime off it."""
    arena.client("pad", FMT_A).alloc(1)


def test_a_private_runtime_stops_at_its_limit_and_gets_the_rest_back_after(
        arena: SlabArena) -> None:
    _padding_taken(arena)
    rt = arena.client("r0", FMT_A)
    arena.table.set_kv_limit("r0", TWO_SLABS)
    assert rt.available_blocks() == 16, "SGLang sees the limit, not the free arena"
    ids = rt.alloc(16)
    rt.check_integrity()
    with pytest.raises(ArenaExhausted, match="KV limit"):
        rt.alloc(1)
    rt.check_integrity()
    assert rt.available_blocks() == 0 and len(ids) == 16
    arena.table.set_kv_limit("r0", None)
    assert rt.available_blocks() == (NUM_SLABS - 3) * 8
    assert len(rt.alloc(8)) == 8, "without the limit the free slabs serve again"
    rt.check_integrity()


def test_the_limit_binds_only_its_runtime(arena: SlabArena) -> None:
    _padding_taken(arena)
    capped, free = arena.client("capped", FMT_A), arena.client("free", FMT_A)
    arena.table.set_kv_limit("capped", SLAB_BYTES)
    capped.alloc(8)
    with pytest.raises(ArenaExhausted):
        capped.alloc(1)
    assert len(free.alloc(8 * (NUM_SLABS - 2))) == 8 * (NUM_SLABS - 2), \
        "a neighbour takes every other slab"
    for rt in (capped, free):
        rt.check_integrity()


def test_a_limit_survives_the_runtimes_restart(arena: SlabArena) -> None:
    _padding_taken(arena)
    first = arena.client("r0", FMT_A)
    arena.table.set_kv_limit("r0", SLAB_BYTES)
    first.close()
    again = arena.client("r0", FMT_A)
    assert arena.table.kv_limit(again.slot) == SLAB_BYTES, "kept by runtime id, not by slot"
    again.alloc(8)
    with pytest.raises(ArenaExhausted):
        again.alloc(1)
    again.check_integrity()


def test_a_limit_set_before_the_runtime_registers_applies_at_once(arena: SlabArena) -> None:
    arena.table.set_kv_limit("later", SLAB_BYTES)
    rt = arena.client("later", FMT_A)
    assert rt.available_blocks() == 8
    assert arena.table.kv_limits() == {"later": SLAB_BYTES}


def test_lowering_a_limit_below_use_takes_nothing_back(arena: SlabArena) -> None:
    _padding_taken(arena)
    rt = arena.client("r0", FMT_A)
    ids = rt.alloc(24)
    arena.table.set_kv_limit("r0", SLAB_BYTES)
    rt.check_integrity()
    (owner,) = [o for o in snapshot(arena.table).owners if o.runtime_id == "r0"]
    assert owner.used_blocks == 24, "held pages stay held"
    assert rt.available_blocks() == 0
    rt.free(ids[8:])
    assert rt.available_blocks() == 0, "one slab held == the limit"
    rt.free(ids[:8])
    assert rt.available_blocks() == 8
    rt.check_integrity()


def test_a_pooled_runtime_is_limited_by_the_blocks_it_holds(arena: SlabArena) -> None:
    _padding_taken(arena)
    a = arena.client("a", FMT_A, pooled=True)
    b = arena.client("b", FMT_A, pooled=True)
    assert isinstance(a, PooledSlabs) and isinstance(b, PooledSlabs)
    arena.table.set_kv_limit("a", TWO_SLABS)
    b.alloc(4)  # a slab of the pool half used by b: a's blocks share it
    taken = a.alloc(16)
    a.check_integrity()
    assert a.available_blocks() == 0
    with pytest.raises(ArenaExhausted, match="KV limit"):
        a.alloc(1)
    a.free(taken[:3])
    a.check_integrity()
    assert a.available_blocks() == 3 and len(a.alloc(3)) == 3
    assert len(b.alloc(8)) == 8, "b has no limit"
    b.check_integrity()


def test_the_snapshot_and_the_inspector_show_the_limit(arena: SlabArena) -> None:
    from fineslab.slabs.inspector import as_dict, render
    arena.client("r0", FMT_A)
    arena.client("r1", FMT_A)
    arena.table.set_kv_limit("r0", TWO_SLABS)
    owners = {o.runtime_id: o for o in snapshot(arena.table).owners}
    assert owners["r0"].kv_limit_bytes == TWO_SLABS and owners["r1"].kv_limit_bytes is None
    listed = as_dict(snapshot(arena.table))["owners"]
    assert isinstance(listed, list) and listed[0]["kv_limit_bytes"] == TWO_SLABS
    assert "KV limit" in render(arena.table.path, snapshot(arena.table))


@pytest.mark.parametrize("bad", [-1, 1 << 63, 10 ** 30])
def test_a_negative_or_over_int64_limit_is_refused(arena: SlabArena, bad: int) -> None:
    with pytest.raises(ConfigError):
        arena.table.set_kv_limit("r0", bad)
    assert arena.table.kv_limits() == {}


def test_the_limit_list_is_bounded_and_clearing_frees_a_row(arena: SlabArena) -> None:
    for i in range(arena.table.dims.max_runtimes):
        arena.table.set_kv_limit(f"r{i}", SLAB_BYTES)
    with pytest.raises(ConfigError, match="limit rows"):
        arena.table.set_kv_limit("one-more", SLAB_BYTES)
    arena.table.set_kv_limit("r0", None)
    arena.table.set_kv_limit("one-more", SLAB_BYTES)
    assert len(arena.table.kv_limits()) == arena.table.dims.max_runtimes


def test_check_integrity_finds_a_slot_whose_limit_differs_from_its_ids(arena: SlabArena) -> None:
    from fineslab.errors import IntegrityError
    from fineslab.slabs.integrity import check_integrity

    rt = arena.client("r0", FMT_A)
    arena.table.set_kv_limit("r0", SLAB_BYTES)
    check_integrity(arena.table)
    arena.table.rt_limit[rt.slot] = 3 * SLAB_BYTES  # a slot copy that went stale
    with pytest.raises(IntegrityError, match="KV limit"):
        check_integrity(arena.table)


def test_a_free_padding_slab_is_not_counted_as_room_for_kv(arena: SlabArena) -> None:
    """The router's free-KV figure (`Fleet.kv_free_tokens`) leaves out a free slab 0, as the
    allocator's available size does: the runtime that draws it parks it whole."""
    free = snapshot(arena.table)
    assert free.padding_slab_free and free.kv_free_slabs == NUM_SLABS - 1
    client = arena.client("a", FMT_A)
    client.alloc(1)  # the first draw takes slab 0
    drawn = snapshot(arena.table)
    assert not drawn.padding_slab_free and drawn.kv_free_slabs == drawn.free_slabs == NUM_SLABS - 1
    client.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["private", "key-pool"])
def test_the_padding_slab_is_not_counted_against_a_runtimes_limit(
        arena: SlabArena, pooled: bool) -> None:
    """The runtime that draws first holds slab 0, where SGLang writes padded tokens (its
    allocator parks it whole): a limit of one slab still leaves it one slab of KV, whether its
    slabs are its own or its key pool's. Counting it left a runtime with no KV, and its requests
    waited until the client gave up (bench.capacity's static partitions, 2026-11-29)."""
    rt = arena.client("r0", FMT_A, pooled=pooled)
    arena.table.set_kv_limit("r0", SLAB_BYTES)
    padding = rt.alloc(8)  # slab 0, whole (a key pool's first slab is slab 0 too)
    (owner,) = snapshot(arena.table).owners
    assert int(arena.table.owner[0]) == (-2 if pooled else rt.slot)
    assert owner.padding_blocks == 8 and owner.limit_blocks(SLAB_BYTES) == 8, owner
    assert rt.available_blocks() == 8 == owner.available_blocks(NUM_SLABS - 1, SLAB_BYTES), \
        "a slab of KV besides the padding slab"
    kv = rt.alloc(8)
    with pytest.raises(ArenaExhausted, match="KV limit"):
        rt.alloc(1)
    rt.check_integrity()
    rt.free(kv)
    rt.free(padding)
    rt.check_integrity()

"""SlabTable + RuntimeSlabs: carving, returning, block ids, refusals, integrity, reclaim."""

from __future__ import annotations

import numpy as np
import pytest
from slab_constants import FMT_A, FMT_B, NUM_SLABS, SLAB_BYTES, dead_pid

from fineslab.errors import ArenaExhausted, ConfigError, IntegrityError, InvalidBlockError
from fineslab.slabs.arena import SlabArena
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape
from fineslab.slabs.integrity import check_integrity, snapshot
from fineslab.slabs.table import SlabState


def test_alloc_returns_engine_block_ids_slab_by_slab(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    ids = rt.alloc(10)
    rt.check_integrity()
    # slab 0: blocks 0..7 (FULL); slab 1: blocks 8, 9 of 8..15 (PARTIAL)
    assert ids == list(range(10)), "ids are slab_id * bps + local, lowest slab first"
    assert arena.table.state[0] == SlabState.FULL and arena.table.state[1] == SlabState.PARTIAL
    assert arena.table.used[:2].tolist() == [8, 2]
    assert rt.num_free_blocks() == 6
    assert rt.available_blocks() == 6 + (NUM_SLABS - 2) * 8


def test_second_format_gets_its_own_slabs(arena: SlabArena) -> None:
    a, b = arena.client("ra", FMT_A), arena.client("rb", FMT_B)
    a.alloc(1)
    ids_b = b.alloc(5)
    for rt in (a, b):
        rt.check_integrity()
    assert b.blocks_per_slab == 4 and ids_b == [4, 5, 6, 7, 8], "B's blocks start in slab 1"
    assert arena.table.key[1] == FMT_B.block_stride_bytes and arena.table.key[0] == 512


def test_empty_slab_returns_at_once(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    ids = rt.alloc(9)
    rt.free(ids[8:])
    rt.check_integrity()
    assert arena.table.state[1] == SlabState.FREE, "slab 1 emptied -> free space"
    rt.free(ids[:3])
    rt.check_integrity()
    assert arena.table.state[0] == SlabState.PARTIAL, "FULL -> PARTIAL on free"
    rt.free(ids[3:8])
    rt.check_integrity()
    assert snapshot(arena.table).free_slabs == NUM_SLABS and rt.num_free_blocks() == 0


def test_freed_blocks_are_reused_before_carving(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    ids = rt.alloc(6)
    rt.free([ids[1], ids[4]])
    again = rt.alloc(3)
    rt.check_integrity()
    assert again == [1, 4, 6], "lowest free blocks of the lowest partial slab first"


def test_prefill_of_a_slab_or_more_takes_whole_fresh_slabs(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    rt.free(rt.alloc(5)[:2])  # slab 0: blocks 2, 3, 4 in use, 5 holes
    ids = rt.alloc(10)
    rt.check_integrity()
    # slab 1 whole (8..15) for the whole-slab part, then the two lowest holes of slab 0
    assert ids == [*range(8, 16), 0, 1], "whole fresh slab first, the rest fills holes"


def test_near_hint_fills_the_requests_slab_first(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    first = rt.alloc(8 + 3)  # slab 0 whole, slab 1: 8, 9, 10
    rt.free([first[1]])  # a hole in slab 0, lower than slab 1's free blocks
    assert rt.alloc(1, near_block=9) == [11], "hinted: the hint's slab, not the lowest hole"
    assert rt.alloc(1) == [1], "unhinted: the lowest hole"
    rt.check_integrity()


@pytest.mark.parametrize("hint", [-5, 10**6, 40])
def test_stale_near_hints_are_ignored(arena: SlabArena, hint: int) -> None:
    rt = arena.client("r0", FMT_A)
    rt.alloc(3)
    assert rt.alloc(2, near_block=hint) == [3, 4], "a hint outside own slabs changes nothing"
    rt.check_integrity()


def test_exhaustion_raises_and_changes_nothing(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    rt.alloc(8 * NUM_SLABS - 3)
    before = arena.table.raw()
    with pytest.raises(ArenaExhausted):
        rt.alloc(4)
    assert arena.table.raw() == before, "a refused alloc leaves the table untouched"
    rt.check_integrity()
    assert len(rt.alloc(3)) == 3, "exactly what is left still fits"


@pytest.mark.parametrize("case", ["double", "foreign", "range", "repeat", "negative"])
def test_bad_free_raises_and_changes_nothing(arena: SlabArena, case: str) -> None:
    rt, other = arena.client("r0", FMT_A), arena.client("r1", FMT_A)
    ids = rt.alloc(5)
    theirs = other.alloc(2)
    rt.free([ids[0]])
    bad = {"double": [ids[1], ids[0]], "foreign": [theirs[0]], "range": [10**9],
           "repeat": [ids[2], ids[2]], "negative": [-1]}[case]
    before = arena.table.raw()
    with pytest.raises(InvalidBlockError):
        rt.free(bad)
    assert arena.table.raw() == before, f"{case}: a refused free leaves the table untouched"
    rt.check_integrity()
    assert rt.num_free_blocks() == 4


def test_negative_alloc_is_refused(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    with pytest.raises(InvalidBlockError):
        rt.alloc(-1)
    assert rt.alloc(0) == []


def test_block_size_that_does_not_fit_is_refused(arena: SlabArena) -> None:
    odd = BlockFormat(KVShape("odd", 2, 2, 8, KVDtype.BF16), 3, 512)
    before = arena.table.raw()
    with pytest.raises(ConfigError):
        arena.client("odd", odd)
    assert arena.table.raw() == before, "a refused registration leaves the table untouched"


def test_live_runtime_id_cannot_attach_twice(arena: SlabArena) -> None:
    arena.client("r0", FMT_A)
    with pytest.raises(ConfigError):
        arena.client("r0", FMT_A)


def test_close_returns_every_slab(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    rt.alloc(20)
    rt.close()
    check_integrity(arena.table)
    assert snapshot(arena.table).free_slabs == NUM_SLABS and not arena.table.active_runtimes()


def test_reclaim_dead_owners_frees_their_slabs(arena: SlabArena) -> None:
    dead, alive = arena.client("dead", FMT_A), arena.client("alive", FMT_B)
    dead.alloc(12)
    alive.alloc(3)
    arena.table.rt_pid[dead.slot] = dead_pid()  # as if its process had been killed
    assert arena.table.reclaim_dead_owners() == ["dead"]
    alive.check_integrity()
    assert int(np.count_nonzero(arena.table.owner == dead.slot)) == 0
    assert snapshot(arena.table).free_slabs == NUM_SLABS - 1


def test_carve_reclaims_dead_owners_when_space_runs_out(arena: SlabArena) -> None:
    dead = arena.client("dead", FMT_A)
    dead.alloc(8 * NUM_SLABS)
    arena.table.rt_pid[dead.slot] = dead_pid()
    rt = arena.client("new", FMT_A)
    assert len(rt.alloc(8 * NUM_SLABS)) == 8 * NUM_SLABS, "dead runtime's slabs came back"
    rt.check_integrity()


def test_lock_holder_death_is_repaired(arena: SlabArena) -> None:
    rt = arena.client("r0", FMT_A)
    rt.alloc(3)
    arena.table.state[4] = SlabState.FREE
    arena.table.key[4] = 512  # a carve cut short: key written, owner and state not yet
    arena.table.header[8] = dead_pid()  # the holder died inside the lock
    rt.check_integrity()  # takes the lock, which repairs first
    assert arena.table.key[4] == 0


@pytest.mark.parametrize("rule", ["T0", "T1-owner", "T1-key", "T2-owner", "T2-key", "T3",
                                  "T4-empty", "T4-full", "T5"])
def test_check_integrity_catches_each_broken_invariant(arena: SlabArena, rule: str) -> None:
    rt = arena.client("r0", FMT_A)
    rt.alloc(10)
    other = arena.client("r1", FMT_A)
    t = arena.table
    if rule == "T0":
        t.state[5] = 7
    elif rule == "T1-owner":
        t.owner[5] = rt.slot
    elif rule == "T1-key":
        t.key[5] = 512
    elif rule == "T2-owner":
        t.owner[1] = 7  # an inactive registry slot
    elif rule == "T2-key":
        t.rt_key[other.slot] = 1024
        t.owner[1] = other.slot
    elif rule == "T3":
        t.free_map[1, 5] = 0
    elif rule == "T4-empty":
        t.free_map[1, :2] = 1
        t.used[1] = 0
    elif rule == "T4-full":
        t.state[0] = SlabState.PARTIAL
    elif rule == "T5":
        t.rt_name[other.slot] = t.rt_name[rt.slot]
    with pytest.raises(IntegrityError, match=rule.split("-")[0]):
        check_integrity(t)


def test_stats_report_usage_per_owner(arena: SlabArena) -> None:
    a, b = arena.client("ra", FMT_A), arena.client("rb", FMT_B)
    a.alloc(9)
    b.alloc(2)
    stats = a.stats()
    usage = {o.runtime_id: o for o in stats.owners}
    assert stats.used_blocks == 9 and stats.used_bytes == 9 * 512
    assert usage["ra"].used_bytes == 9 * 512 and usage["rb"].used_bytes == 2 * 1024
    assert usage["rb"].num_slabs == 1 and stats.free_slabs == NUM_SLABS - 3


def test_slab_bytes_hold_their_blocks(arena: SlabArena) -> None:
    import torch

    from fineslab.slabs.views import layer_views

    rt = arena.client("r0", FMT_A)
    arena.client("pad", FMT_B).alloc(1)  # slab 0 goes to B, so A's blocks start in slab 1
    block = rt.alloc(1)[0]
    tensor = arena.tensor()
    assert isinstance(tensor, torch.Tensor)
    kv = layer_views(tensor, FMT_A)
    slots = range(block * FMT_A.tokens_per_block, (block + 1) * FMT_A.tokens_per_block)
    for layer in kv:
        layer.k[list(slots)] = 1.0
        layer.v[list(slots)] = 1.0
    touched = torch.nonzero(tensor).flatten()
    slab = block // rt.blocks_per_slab
    assert slab == 1 and int(touched.min()) >= slab * SLAB_BYTES
    assert int(touched.max()) < (slab + 1) * SLAB_BYTES, "a block's bytes lie in its slab"


def test_the_slab_epoch_moves_when_a_slab_changes_owner_and_only_then(arena: SlabArena) -> None:
    """Key pools cache their pool's slabs by this counter, so every carve and free must move it
    and a block taken from a slab already carved need not."""
    client = arena.client("a", FMT_A)
    epoch = arena.table.slab_epoch
    blocks = client.alloc(1)  # carves a slab
    assert arena.table.slab_epoch > epoch
    carved = arena.table.slab_epoch
    more = client.alloc(1)  # same slab
    assert arena.table.slab_epoch == carved
    client.free(blocks + more)  # the slab empties and goes back
    assert arena.table.slab_epoch > carved
    client.close()


def test_a_key_pool_sees_a_slab_another_table_handle_carved(arena: SlabArena,
                                                            tmp_path: object) -> None:
    """Two processes' views of one table (here two handles): a slab the other carved into the
    pool, partly used, is where this runtime's next block comes from (the lowest partial)."""
    from fineslab.slabs.pooled import PooledSlabs
    from fineslab.slabs.table import SlabTable

    other_table = SlabTable.open(arena.table.path)
    mine = PooledSlabs(arena.table, "mine", FMT_A, cache_blocks=0)  # placement exact
    other = PooledSlabs(other_table, "other", FMT_A, cache_blocks=0)
    held = mine.alloc_array(3)  # slab 0, cached by epoch
    filler = other.alloc_array(8 - 3)  # fills slab 0
    assert np.all(filler < 8), "the other runtime fills the pool's lowest partial slab first"
    theirs = other.alloc_array(1)  # carves slab 1 into the pool: the epoch moves
    got = mine.alloc_array(1)
    assert int(got[0]) // 8 == int(theirs[0]) // 8 == 1, (
        "this runtime must find the slab the other handle carved, not carve one of its own")
    mine.free(np.concatenate([held, got]))
    other.free(np.concatenate([filler, theirs]))
    check_integrity(arena.table)
    mine.close()
    other.close()
    other_table.close()


def test_threads_sharing_one_table_handle_take_the_lock_in_turn(
        arena: SlabArena, caplog: pytest.LogCaptureFixture) -> None:
    """flock excludes other open files, not two threads on one handle (the launcher's
    reclaimer, elastic manager and ctl handlers share the arena's). Without the thread lock the
    second thread entered at once and, seeing the first one's holder mark, "repaired" the table
    under it as if its holder had died."""
    import threading
    import time

    table = arena.table
    inside = threading.Event()
    order: list[str] = []

    def first() -> None:
        with table.lock():
            inside.set()
            time.sleep(0.3)
            order.append("first leaves")

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(5)
    with table.lock():
        order.append("second enters")
        with table.lock():  # nested in one thread: no deadlock, the file lock still held
            assert table.lock_holder_pid == table.me.pid
        assert table.lock_holder_pid == table.me.pid, "the inner exit must not release it"
    thread.join(5)
    assert order == ["first leaves", "second enters"]
    assert "died holding the lock" not in caplog.text
    assert table.lock_holder_pid == 0

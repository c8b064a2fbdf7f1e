"""Hypothesis state machines: alloc/free/carve/return against a model of live blocks per runtime
(private slabs; and key pools beside a private runtime).

The model knows only which block ids each runtime holds. From it follow every slab's owner and
count (an empty slab is FREE at once), so the machine checks the table slab by slab, plus
check_integrity, after every step; and it predicts exactly when an alloc must fail.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from tempfile import mkdtemp
from typing import Protocol

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from slab_constants import FMT_A, FMT_B, NUM_SLABS, SLAB_BYTES

from fineslab.errors import ArenaExhausted, InvalidBlockError
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.integrity import check_integrity
from fineslab.slabs.pooled import PooledSlabs
from fineslab.slabs.table import SlabState

RUNTIMES = st.sampled_from([0, 1])


class _Machine(Protocol):
    arena: SlabArena
    clients: list
    live: list[set[int]]


def _free_some(machine: _Machine, rt: int, data: st.DataObject) -> None:
    """Free a drawn, non-empty subset of runtime `rt`'s live blocks, and update the model."""
    if not machine.live[rt]:
        return
    chosen = data.draw(st.lists(st.sampled_from(sorted(machine.live[rt])), min_size=1,
                                unique=True))
    machine.clients[rt].free(chosen)
    machine.live[rt] -= set(chosen)


def _refused_free(machine: _Machine, rt: int, block: int) -> None:
    """A free of a block `rt` does not hold is refused and leaves the table byte for byte."""
    if block in machine.live[rt]:
        return
    before = machine.arena.table.raw()
    try:
        machine.clients[rt].free([block])
    except InvalidBlockError:
        assert machine.arena.table.raw() == before, "a refused free changes nothing"
    else:
        raise AssertionError(f"freeing block {block} not held by runtime {rt} succeeded")


class SlabMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        spec = ArenaSpec("hyp", "cpu0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
        self.shm_dir = Path(mkdtemp(prefix="fineslab-hyp-"))
        self.arena = SlabArena.create(spec, shm_dir=self.shm_dir)
        self.clients = [self.arena.client("ra", FMT_A), self.arena.client("rb", FMT_B)]
        self.live: list[set[int]] = [set(), set()]

    def _slabs_of(self, rt: int) -> set[int]:
        return {b // self.clients[rt].blocks_per_slab for b in self.live[rt]}

    def _room(self, rt: int) -> int:
        bps = self.clients[rt].blocks_per_slab
        own_free = len(self._slabs_of(rt)) * bps - len(self.live[rt])
        taken = len(self._slabs_of(0) | self._slabs_of(1))
        return own_free + (NUM_SLABS - taken) * bps

    @rule(rt=RUNTIMES, num_blocks=st.integers(0, 20),
          near=st.none() | st.integers(-2, NUM_SLABS * 8 + 2))
    def alloc(self, rt: int, num_blocks: int, near: int | None) -> None:
        room = self._room(rt)
        before, squeeze = self.arena.table.raw(), self.arena.table.pool_squeeze
        try:
            ids = self.clients[rt].alloc(num_blocks, near_block=near)
        except ArenaExhausted:
            assert num_blocks > room, "alloc fails only when the model says it must"
            self.arena.table.header[13] = squeeze  # a short pool moves the squeeze counter
            assert self.arena.table.raw() == before, "a failed alloc changes nothing else"
            return
        assert num_blocks <= room
        assert len(ids) == num_blocks == len(set(ids)), "distinct ids, as many as asked"
        assert not set(ids) & self.live[rt], "never a live block twice"
        self.live[rt] |= set(ids)
        assert not self._slabs_of(0) & self._slabs_of(1), "no slab holds two runtimes' blocks"

    @precondition(lambda self: self.live[0] or self.live[1])
    @rule(rt=RUNTIMES, data=st.data())
    def free(self, rt: int, data: st.DataObject) -> None:
        _free_some(self, rt, data)

    @rule(rt=RUNTIMES, block=st.integers(-2, NUM_SLABS * 8 + 2))
    def bad_free(self, rt: int, block: int) -> None:
        _refused_free(self, rt, block)

    @invariant()
    def table_matches_model(self) -> None:
        for client in self.clients:
            client.check_integrity()
        check_integrity(self.arena.table)
        table = self.arena.table
        expected_used = np.zeros(NUM_SLABS, dtype=np.int64)
        for rt, client in enumerate(self.clients):
            for block in self.live[rt]:
                slab = block // client.blocks_per_slab
                expected_used[slab] += 1
                assert table.owner[slab] == client.slot, "a live block's slab is its owner's"
        assert table.used.tolist() == expected_used.tolist(), "used counts match the model"
        assert ((table.state == SlabState.FREE) == (expected_used == 0)).all(), (
            "a slab is FREE exactly when it holds no live block")

    def teardown(self) -> None:
        self.arena.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)  # one folder per example: ~160 a run


SlabMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         derandomize=True)
TestSlabMachine = SlabMachine.TestCase


class PooledSlabMachine(RuleBasedStateMachine):
    """Two runtimes in FMT_A's key pool and one private FMT_B runtime, against the model of
    live blocks: a pooled slab may hold both pooled runtimes' blocks, never the private one's."""

    def __init__(self) -> None:
        super().__init__()
        spec = ArenaSpec("hyp-pool", "cpu0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
        self.shm_dir = Path(mkdtemp(prefix="fineslab-hyp-"))
        self.arena = SlabArena.create(spec, shm_dir=self.shm_dir)
        # no block caches: the model predicts every refusal (test_slab_pool_cache.py has a
        # seeded random run with them)
        self.clients = [PooledSlabs(self.arena.table, "pa", FMT_A, cache_blocks=0),
                        PooledSlabs(self.arena.table, "pb", FMT_A, cache_blocks=0),
                        self.arena.client("rb", FMT_B)]
        self.live: list[set[int]] = [set(), set(), set()]

    def _slabs(self, rts: list[int]) -> set[int]:
        return {b // self.clients[rt].blocks_per_slab for rt in rts for b in self.live[rt]}

    def _room(self, rt: int) -> int:
        bps = self.clients[rt].blocks_per_slab
        mates = [0, 1] if rt < 2 else [2]
        held = len(self._slabs(mates)) * bps - sum(len(self.live[m]) for m in mates)
        taken = len(self._slabs([0, 1]) | self._slabs([2]))
        return held + (NUM_SLABS - taken) * bps

    @rule(rt=st.sampled_from([0, 1, 2]), num_blocks=st.integers(0, 20),
          near=st.none() | st.integers(-2, NUM_SLABS * 8 + 2))
    def alloc(self, rt: int, num_blocks: int, near: int | None) -> None:
        room = self._room(rt)
        before, squeeze = self.arena.table.raw(), self.arena.table.pool_squeeze
        try:
            ids = self.clients[rt].alloc(num_blocks, near_block=near)
        except ArenaExhausted:
            assert num_blocks > room, "alloc fails only when the model says it must"
            self.arena.table.header[13] = squeeze  # a short pool moves the squeeze counter
            assert self.arena.table.raw() == before, "a failed alloc changes nothing else"
            return
        assert num_blocks <= room
        assert len(ids) == num_blocks == len(set(ids)), "distinct ids, as many as asked"
        assert not set(ids) & (self.live[0] | self.live[1] if rt < 2 else self.live[2]), \
            "never a live block twice"
        self.live[rt] |= set(ids)
        assert not self._slabs([0, 1]) & self._slabs([2]), "pools and private slabs stay apart"

    @precondition(lambda self: any(self.live))
    @rule(rt=st.sampled_from([0, 1, 2]), data=st.data())
    def free(self, rt: int, data: st.DataObject) -> None:
        _free_some(self, rt, data)

    @rule(rt=st.sampled_from([0, 1]), block=st.integers(-2, NUM_SLABS * 8 + 2))
    def bad_free(self, rt: int, block: int) -> None:
        _refused_free(self, rt, block)

    @invariant()
    def table_matches_model(self) -> None:
        check_integrity(self.arena.table)
        self.clients[2].check_integrity()
        table = self.arena.table
        expected_used = np.zeros(NUM_SLABS, dtype=np.int64)
        for rt, client in enumerate(self.clients):
            for block in self.live[rt]:
                slab, local = divmod(block, client.blocks_per_slab)
                expected_used[slab] += 1
                if rt < 2:
                    assert table.block_owner[slab, local] == self.clients[rt].slot + 1, \
                        "a pooled block records its runtime"
        assert table.used.tolist() == expected_used.tolist(), "used counts match the model"
        assert ((table.state == SlabState.FREE) == (expected_used == 0)).all(), (
            "a slab is FREE exactly when it holds no live block")
        for rt in (0, 1):
            assert self.clients[rt].num_used_blocks() == len(self.live[rt])

    def teardown(self) -> None:
        self.arena.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)  # one folder per example: ~160 a run


PooledSlabMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                               deadline=None, derandomize=True)
TestPooledSlabMachine = PooledSlabMachine.TestCase

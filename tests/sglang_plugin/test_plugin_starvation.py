"""A lone request starved by a neighbour: held by the scheduler hook, never by a sleep.

The allocator answers at once (`test_plugin_allocator.py`); the policy (`starvation.py`) decides
to skip a decode step while the neighbours hold the memory, up to its bound; the hook
(`PluginSession.update_running_batch`) returns None for a skipped step, as SGLang does itself.
Fakes stand for SGLang's scheduler and batch; the allocator is real, over a CPU arena where a
second runtime plays the neighbour:

    arena: 4 slabs x 4 blocks of 16 tokens; slab 0 parked (padding); the neighbour takes the rest

The slow test runs a real SGLang server and starves its only request mid-decode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from plugin_test_support import (
    Reference,
    ScratchArena,
    arena_for,
    kv_shape,
    plugin_outputs,
    prompts,
    slab_allocator,
)

from fineslab.sglang_plugin import ArenaJoin
from fineslab.sglang_plugin.allocator import SlabAllocator
from fineslab.sglang_plugin.hooks import PluginSession
from fineslab.sglang_plugin.starvation import DecodeShortfall, StarvedRequestPolicy
from fineslab.slabs import KVDtype, KVShape, RuntimeSlabs
from fineslab.slabs.sizing import fit_format

PAGE = 16
SLAB_BYTES = 64 << 10
NUM_SLABS = 4
SHAPE = KVShape("m", 2, 2, 64, KVDtype.BF16)  # 16 KiB blocks, 4 a slab


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeBatch:
    """What the hook reads of SGLang's ScheduleBatch."""

    num_reqs: int
    tokens_next_decode: int = PAGE
    tree_cache: object = None
    batch_is_full: bool = False

    def batch_size(self) -> int:
        return self.num_reqs

    def new_tokens_required_next_decode(self) -> int:
        return self.tokens_next_decode


@dataclass
class FakeScheduler:
    token_to_kv_pool_allocator: SlabAllocator
    decoded: list[FakeBatch] = field(default_factory=list)
    waiting_queue: list[object] = field(default_factory=list)
    tree_cache: object = None  # SGLang's prefix cache: none here, nothing to give back

    def update_running_batch(self, batch: FakeBatch) -> FakeBatch:
        """Stands for SGLang's own update (decode, retract or abort)."""
        self.decoded.append(batch)
        return batch


@dataclass
class Starved:
    scheduler: FakeScheduler
    session: PluginSession
    clock: FakeClock
    neighbour: RuntimeSlabs
    grabbed: list[int]

    def step(self, batch: FakeBatch) -> FakeBatch | None:
        result: FakeBatch | None = self.session.update_running_batch(
            FakeScheduler.update_running_batch, self.scheduler, batch)
        return result


@pytest.fixture
def starved() -> Iterator[Starved]:
    arena = ScratchArena.create(SLAB_BYTES, NUM_SLABS, 4)
    fmt = fit_format(SHAPE, SLAB_BYTES, [PAGE])
    assert fmt is not None
    source = arena.arena.client("m", fmt)
    neighbour = arena.arena.client("n", fmt)
    allocator = slab_allocator(arena, source, fmt, PAGE, (NUM_SLABS - 1) * 4 * PAGE)
    grabbed = neighbour.alloc(neighbour.available_blocks())
    clock = FakeClock()
    session = PluginSession(ArenaJoin("never-opened", "m"),
                            starvation=StarvedRequestPolicy(hold_s=60.0, clock=clock))
    yield Starved(FakeScheduler(allocator), session, clock, neighbour, grabbed)
    allocator.clear()
    source.close()
    neighbour.close()
    arena.close()


@pytest.mark.parametrize("waiting, running, formed, sleeps", [
    (1, 0, False, True),   # requests wait for memory, none runs, none admitted: back off
    (1, 1, False, False),  # a request decodes: the loop has work, no sleep
    (1, 0, True, False),   # a prefill was admitted: no sleep
    (0, 0, False, False),  # nothing waits: SGLang's own idle sleeper decides
])
def test_a_turn_that_admits_nothing_while_requests_wait_for_memory_backs_off(
        starved: Starved, monkeypatch: pytest.MonkeyPatch, waiting: int, running: int,
        formed: bool, sleeps: bool) -> None:
    """The live capacity grid: starved schedulers spun a core each until memory came back."""
    from fineslab.sglang_plugin import hooks

    slept: list[float] = []
    monkeypatch.setattr(hooks.time, "sleep", slept.append)
    starved.scheduler.waiting_queue = ["request"] * waiting
    batch, new = FakeBatch(running), FakeBatch(1) if formed else None

    def admission(scheduler: FakeScheduler, delayer: object, running_batch: FakeBatch
                  ) -> tuple[FakeBatch | None, FakeBatch]:
        return new, running_batch  # SGLang's (new batch, running batch)

    result = starved.session.new_batch_prefill(admission, starved.scheduler, None, batch)
    assert result == (new, batch)
    assert slept == ([hooks.STARVED_BACKOFF_S] if sleeps else [])


def test_policy_holds_only_a_lone_request_the_neighbours_starve() -> None:
    clock = FakeClock()
    policy = StarvedRequestPolicy(hold_s=60.0, clock=clock)
    assert not policy.hold(DecodeShortfall(1, fits=True, within_own_cap=True)), "fed: decode"
    assert not policy.hold(DecodeShortfall(3, fits=False, within_own_cap=True)), (
        "several requests: SGLang retracts some, their pages feed the rest")
    assert not policy.hold(DecodeShortfall(1, fits=False, within_own_cap=False)), (
        "short of its own cap (--max-total-tokens): no neighbour will help, SGLang decides")
    assert policy.hold(DecodeShortfall(1, fits=False, within_own_cap=True))
    clock.now += 59.9
    assert policy.hold(DecodeShortfall(1, fits=False, within_own_cap=True)), "within the bound"
    clock.now += 0.1
    assert not policy.hold(DecodeShortfall(1, fits=False, within_own_cap=True)), (
        "after hold_s SGLang may abort: two runtimes starving each other must not hang")
    assert policy.hold(DecodeShortfall(1, fits=False, within_own_cap=True)), (
        "the next starved request starts a new hold")


def test_hook_skips_the_step_at_once_and_decodes_when_memory_frees(
        starved: Starved, monkeypatch: pytest.MonkeyPatch) -> None:
    # No sleep anywhere on this path (a bound on the elapsed time failed on a loaded machine).
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    lone = FakeBatch(1)
    assert starved.step(lone) is None, "a starved lone request skips this decode step"
    assert slept == [], "the hook must not wait inside SGLang's loop"
    assert starved.scheduler.decoded == [], "SGLang's update (which would abort) did not run"
    starved.clock.now += 30
    assert starved.step(lone) is None, "still starved, still within the bound: skip again"

    freed = starved.grabbed[4:8]  # slab 1 (slab 0 is the padding slab)
    starved.neighbour.free(freed)
    assert starved.step(lone) is lone, "memory freed: SGLang's own update decodes"
    allocator = starved.scheduler.token_to_kv_pool_allocator
    assert allocator.available_size() >= PAGE, "the hook's check reserved the step's page"
    assert allocator.check_integrity() == []


def test_hook_lets_sglang_abort_after_the_bound(starved: Starved) -> None:
    lone = FakeBatch(1)
    assert starved.step(lone) is None
    starved.clock.now += 60
    assert starved.step(lone) is lone, "past the bound SGLang runs its own path (abort)"


def test_hook_leaves_several_requests_to_sglangs_retraction(starved: Starved) -> None:
    pair = FakeBatch(2, tokens_next_decode=2 * PAGE)
    assert starved.step(pair) is pair, "with several requests SGLang retracts as it does"
    assert starved.step(FakeBatch(0)) is not None, "an empty batch goes to SGLang untouched"


@pytest.mark.slow
def test_a_starved_runtime_finishes_its_request_once_memory_frees(
        model_cache: Path, stock_outputs: Reference) -> None:
    """A real runtime decodes one long request; early on the test process (a neighbour runtime
    in the same table) takes every free slab, holds them for 3 s, then gives them back. The
    request must stall (its pages stop growing, and it is not aborted, as SGLang would abort
    its last request) and then finish with its stand-alone output.

        slabs of 96 KiB = 3 blocks of 16 llama-tiny tokens; 24 slabs; 24 + 600 tokens = 39 pages
        grab when "m" holds 3 slabs (the padding slab + 6 pages): 33 pages still to come
    """
    model, page, slab_bytes, new_tokens = "llama-tiny", 16, 96 << 10, 600
    prompt = [list(p) for p in prompts(1, 24, seed=31)]
    shape = kv_shape(model, "bfloat16", "m")
    arena = arena_for([shape], page, slab_bytes, 24)
    fmt = fit_format(shape, slab_bytes, [page])
    assert fmt is not None
    neighbour = arena.arena.client("n", fmt)
    result: dict[str, list[list[int]]] = {}
    runtime = threading.Thread(target=lambda: result.__setitem__("out", plugin_outputs(
        model_cache / model, prompt, page_size=page, join=arena.join("m"),
        max_new_tokens=new_tokens)))
    try:
        runtime.start()
        while runtime.is_alive() and arena.used_bytes().get("m", 0) < 3 * slab_bytes:
            time.sleep(0.005)
        at_grab = arena.used_bytes().get("m", 0)
        grabbed = neighbour.alloc(neighbour.available_blocks())
        time.sleep(1.0)  # what is left in its own slab goes first
        held_before = arena.used_bytes().get("m", 0)
        time.sleep(2.0)
        held_after = arena.used_bytes().get("m", 0)
        running = runtime.is_alive()
        neighbour.free(grabbed)
        runtime.join(600)
    finally:
        neighbour.close()
        arena.close()
    assert 3 * slab_bytes <= at_grab <= 6 * slab_bytes, (
        f"the neighbour must take the memory early in the request (the runtime held {at_grab} B "
        "then; it needs 14 slabs): a late grab would test nothing")
    assert running and held_after == held_before >= at_grab, (
        f"the request must stall, neither decoding nor aborted, while the neighbour holds every "
        f"free slab (held {held_before} then {held_after} B)")
    stock = stock_outputs(model, page, "bfloat16", tuple(tuple(p) for p in prompt), new_tokens)
    assert result.get("out") == stock, (
        "the starved request must finish once memory frees, with its stand-alone output")

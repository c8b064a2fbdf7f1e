"""Oneiros' lender in a launched fleet (fleet/layer_lending.py applying
scheduler/oneiros.LayerLendPolicy), against hand-worked rounds: the arena is a TableSnapshot,
the runtimes' stream states are real files, the requests it writes are read back. The policy
alone: tests/scheduler/test_layer_lend_policy.py; the real fleet: test_streaming_fleet.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fineslab.scheduler.oneiros import LayerLendConfig

from fineslab.fleet.layer_lending import Lender, LenderSpec
from fineslab.slabs.integrity import TableSnapshot
from fineslab.slabs.streamctl import (
    StreamState,
    read_request,
    request_path,
    state_path,
    write_state,
)

CFG = LayerLendConfig()
SLAB = 1 << 20
NUM_SLABS = 40
LAYER = 2 * SLAB  # each layer of the runtimes below is two slabs


def _snap(free_slabs: int) -> TableSnapshot:
    return TableSnapshot(SLAB, NUM_SLABS, {(0, "FREE"): free_slabs}, ())


class World:
    """One device: the runtimes' published states and what the arena and the router say."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.free_slabs = 0
        self.pressed = False
        self.stalled = False
        self.demand: dict[str, int] = {}
        self.now_s = 100.0
        for runtime in ("idle-a", "idle-b", "busy"):
            write_state(state_path("f", runtime, folder),
                        StreamState(seq=0, num_layers=4, layer_bytes=LAYER))

    def lender(self, specs: list[LenderSpec]) -> Lender:
        return Lender("f", self.folder, specs, lambda d: _snap(self.free_slabs),
                      lambda d: self.pressed, lambda: self.demand, clock=lambda: self.now_s,
                      stalled=lambda d: self.stalled)

    def requested(self, runtime: str) -> list[int] | None:
        request = read_request(request_path("f", runtime, self.folder))
        return None if request is None else list(request.layers)


def _specs(**caps: int) -> list[LenderSpec]:
    return [LenderSpec(runtime, runtime, "cpu", priority=0, cap=cap)
            for runtime, cap in caps.items()]


def test_nothing_is_lent_before_the_pressure_has_lasted(tmp_path: Path) -> None:
    world = World(tmp_path)
    lender = world.lender(_specs(**{"idle-a": 2}))
    world.pressed = True
    assert lender.run_once() == [], "one pressed round: the cache reclaimer goes first"
    assert world.requested("idle-a") is None


def test_an_idle_model_lends_its_first_layers_counting_its_slot(tmp_path: Path) -> None:
    """The first lent layer of a model pays for its slot buffer, so the first plan asks for two
    layers' bytes: two evenly spaced layers of the idle model (0 and 2 of 4)."""
    world = World(tmp_path)
    lender = world.lender(_specs(**{"idle-a": 2, "busy": 2}))
    world.pressed, world.demand = True, {"busy": 3}
    lender.run_once()
    changes = lender.run_once()
    assert changes == [("idle-a", "lend", 0), ("idle-a", "lend", 2)]
    assert world.requested("idle-a") == [0, 2]
    assert world.requested("busy") is None, "an active model lends nothing here"


def test_idle_models_lend_round_robin_most_recently_used_first_within_their_caps(
        tmp_path: Path) -> None:
    """Two idle models of one priority: idle-b was used last, so it leads the round robin.
    Both lend their first layer (each paying its slot), so the first plan takes three layers;
    then idle-a is at its cap of one and only idle-b lends more, up to its cap of three."""
    world = World(tmp_path)
    lender = world.lender(_specs(**{"idle-a": 1, "idle-b": 3}))
    world.now_s, world.demand = 50.0, {"idle-b": 1}
    lender.run_once()
    world.now_s, world.demand, world.pressed = 100.0, {}, True
    lender.run_once()
    assert lender.run_once() == [("idle-b", "lend", 0), ("idle-a", "lend", 0),
                                 ("idle-b", "lend", 2)]
    lender.run_once()
    assert lender.run_once() == [("idle-b", "lend", 1)], "idle-a is at its cap"
    assert world.requested("idle-a") == [0] and world.requested("idle-b") == [0, 1, 2]
    lender.run_once()
    assert lender.run_once() == [], "both at their caps"


def test_layers_come_back_latest_first_once_the_arena_has_room_for_them(
        tmp_path: Path) -> None:
    world = World(tmp_path)
    lender = world.lender(_specs(**{"idle-a": 2}))
    world.pressed = True
    lender.run_once()
    lender.run_once()
    assert world.requested("idle-a") == [0, 2]
    world.pressed = False
    low_water = int(CFG.low_free_fraction * NUM_SLABS)
    world.free_slabs = low_water + 1  # not a whole layer above the low-water mark
    assert lender.run_once() == []
    world.free_slabs = low_water + 2
    assert lender.run_once() == [("idle-a", "revert", 2)], "the latest lent comes back first"
    assert world.requested("idle-a") == [0]
    world.free_slabs = NUM_SLABS
    assert lender.run_once() == [("idle-a", "revert", 0)]
    assert world.requested("idle-a") == []


def test_a_runtime_not_yet_up_is_left_alone(tmp_path: Path) -> None:
    world = World(tmp_path)
    state_path("f", "idle-a", tmp_path).unlink()
    lender = world.lender(_specs(**{"idle-a": 2}))
    world.pressed = True
    lender.run_once()
    assert lender.run_once() == [] and world.requested("idle-a") is None


@pytest.mark.parametrize("cap", [4, 9])
def test_a_cap_of_every_layer_still_keeps_one_resident(tmp_path: Path, cap: int) -> None:
    world = World(tmp_path)
    lender = world.lender(_specs(**{"idle-a": cap}))
    world.pressed = True
    for _ in range(12):
        lender.run_once()
    assert len(world.requested("idle-a") or []) == 3, "never a whole model"


def test_a_refused_request_puts_the_ledger_back_to_what_the_runtime_streams(
        tmp_path: Path) -> None:
    """The runtime refused (its state carries the error and the request's seq): the lender
    believes the runtime, not its own ledger, and asks again on the next pressed rounds."""
    world = World(tmp_path)
    lender = world.lender(_specs(**{"idle-a": 2}))
    world.pressed = True
    lender.run_once()
    assert [c[1] for c in lender.run_once()] == ["lend", "lend"]
    seq = read_request(request_path("f", "idle-a", tmp_path)).seq  # type: ignore[union-attr]
    write_state(state_path("f", "idle-a", tmp_path), StreamState(
        seq=seq, layers=[], num_layers=4, layer_bytes=LAYER, error="0 free of 40"))
    lender.run_once()
    assert lender.policy.ledger("cpu").order == [], "the ledger follows the runtime"
    assert lender.run_once() == [("idle-a", "lend", 0), ("idle-a", "lend", 2)], "asked again"


def _timed(folder: Path, runtime: str, decode_s: float, passes: int,
           copy_s_per_layer: float | None = None) -> None:
    """Publish `runtime`'s state with `passes` timed decode passes of `decode_s`, and (when
    given) copies that took `copy_s_per_layer` a layer."""
    copied = {} if copy_s_per_layer is None else {
        "streamed_bytes": 10 * LAYER, "copy_seconds": 10 * copy_s_per_layer}
    write_state(state_path("f", runtime, folder), StreamState(
        seq=0, num_layers=4, layer_bytes=LAYER, decode_compute_s=decode_s,
        decode_passes=passes, **copied))


def test_an_active_model_lends_once_idle_ones_are_capped_while_its_copies_fit_its_step(
        tmp_path: Path) -> None:
    """idle-a lends its cap of one first. Then busy, active in the router, may lend while its
    copies take at most a tenth of its timed decode pass (the streamer copies synchronously):
    a 25 ms pass and 1 ms copies (as it timed them) fit two layers, and a third would not."""
    world = World(tmp_path)
    _timed(tmp_path, "busy", 0.025, CFG.min_decode_passes, copy_s_per_layer=0.001)
    lender = world.lender(_specs(**{"idle-a": 1, "busy": 3}))
    world.pressed, world.demand = True, {"busy": 2}
    lender.run_once()
    first = lender.run_once()
    assert first[0] == ("idle-a", "lend", 0), "the idle model lends first"
    for _ in range(8):
        lender.run_once()
    assert world.requested("idle-a") == [0]
    assert world.requested("busy") == [0, 2], "two layers: 2 ms of copies <= 2.5 ms"


def test_an_active_model_with_too_few_timed_passes_or_too_short_a_step_lends_nothing(
        tmp_path: Path) -> None:
    world = World(tmp_path)
    _timed(tmp_path, "busy", 0.025, CFG.min_decode_passes - 1, copy_s_per_layer=0.001)
    lender = world.lender(_specs(**{"busy": 3}))
    world.pressed, world.demand = True, {"busy": 2}
    for _ in range(4):
        lender.run_once()
    assert world.requested("busy") is None, "T_compute not yet believed"
    _timed(tmp_path, "busy", 0.009, CFG.min_decode_passes, copy_s_per_layer=0.001)
    for _ in range(4):
        lender.run_once()
    assert world.requested("busy") is None, "a 9 ms pass: no 1 ms copy fits a tenth of it"
    _timed(tmp_path, "busy", 0.005, CFG.min_decode_passes)  # no copy timed yet
    for _ in range(8):
        lender.run_once()
    assert world.requested("busy") == [0, 2], (
        "before any timed copy T_T is the host link's (2 MiB at 8 GiB/s, 0.24 ms): two "
        "copies (0.49 ms) fit a tenth of a 5 ms pass, three (0.73 ms) do not")


def test_an_active_model_lends_beyond_its_bound_once_the_arena_has_stalled_for_a_while(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """busy alone, active and out of memory: a 9 ms pass fits no 1 ms copy in its tenth, so it
    lends nothing while the arena is merely pressed. Once the reclaimer also finds it stalled
    (a runtime with work holding the same blocks) for STARVED_ROUNDS rounds, it lends up to
    its cap, with a warning: its requests could make no progress at all (the CI case: a lender
    whose copies, timed on a loaded machine, never fitted, its requests waiting for ever)."""
    world = World(tmp_path)
    _timed(tmp_path, "busy", 0.009, CFG.min_decode_passes, copy_s_per_layer=0.001)
    lender = world.lender(_specs(**{"busy": 2}))
    world.pressed, world.demand = True, {"busy": 2}
    for _ in range(3 * CFG.starved_rounds):
        lender.run_once()
    assert world.requested("busy") is None, "pressed but not stalled: the bound holds"
    world.stalled = True
    for _ in range(CFG.starved_rounds - 1):
        lender.run_once()
    assert world.requested("busy") is None, "stalled, not yet for STARVED_ROUNDS"
    with caplog.at_level("WARNING", logger="fineslab.fleet.layer_lending"):
        lender.run_once()
    assert world.requested("busy") == [0, 2], "its cap of 2 at once (the first pays its slot)"
    assert "busy lends beyond its bound" in caplog.text, caplog.text

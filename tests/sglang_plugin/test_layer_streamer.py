"""The layer streamer's mechanism (issue #17) on a small torch model with decoder layers named
`layers.<i>` and one module shared by every layer (as SGLang shares its rotary embedding):
real shared memory, real mmap, the real slab table. The SGLang runtime tests are in
test_plugin_streaming.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.sglang_plugin.streaming import LayerStreamer, install_hooks, is_decode
from fineslab.sglang_plugin.weights import SHARED, collect, move_into_region
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.streamctl import StreamRequest
from fineslab.slabs.weights import WeightRegion, free_weight_slabs

SLAB = 64 * 1024
WIDTH = 96  # one layer: 2 * 96 * 96 * 4 B = 72 KiB: two slabs


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, WIDTH), persistent=False)


class Block(torch.nn.Module):
    def __init__(self, shared: Shared) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.down = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.rotary = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * self.rotary.table


class Toy(torch.nn.Module):
    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        shared = Shared()
        self.embed = torch.nn.Embedding(50, WIDTH)
        self.layers = torch.nn.ModuleList(Block(shared) for _ in range(num_layers))
        self.head = torch.nn.Linear(WIDTH, 50, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture()
def arena(tmp_path: Path):  # type: ignore[no-untyped-def]
    spec = ArenaSpec("ls", "cpu0", 40 * SLAB, SLAB, 64, max_runtimes=4)
    with SlabArena.create(spec, shm_dir=tmp_path) as created:
        yield created


def _streamed_toy(arena: SlabArena, tmp_path: Path) -> tuple[Toy, LayerStreamer]:
    torch.manual_seed(0)
    model = Toy()

    def make(nbytes: int) -> WeightRegion:
        region = WeightRegion(arena.table, arena.paths.data, "toy", nbytes)
        region.back()
        return region

    region, moved = move_into_region(model, make, slab_bytes=SLAB)
    streamer = LayerStreamer(region, moved.layers, tmp_path / "toy.weights")
    install_hooks(streamer, model)
    return model, streamer


def _free_slabs(arena: SlabArena) -> int:
    """Free slabs weights can take (all but slab 0, which no weights here touch)."""
    return free_weight_slabs(arena.table)


def test_layers_get_whole_slabs_of_their_own_and_a_shared_module_stays_shared(
        arena: SlabArena, tmp_path: Path) -> None:
    model, streamer = _streamed_toy(arena, tmp_path)
    spans = sorted(streamer.spans.values(), key=lambda s: s.layer)
    assert [s.layer for s in spans] == [0, 1, 2, 3]
    for before, after in itertools.pairwise(spans):
        assert before.first_slab + before.num_slabs <= after.first_slab, "no slab shared"
        assert after.start == after.first_slab * SLAB, "each layer starts on a slab"
    table_group = [g for g in collect(model) if any(t is model.layers[0].rotary.table
                                                    for t in g.tensors)]
    assert table_group and table_group[0].layer == SHARED, "held by every layer: not lent"
    streamer.close()


@pytest.mark.parametrize(("layers", "slots"), [((1, 3), 1), ((1, 3), 2), ((3,), 1),
                                              ((0, 1, 2), 1), ((0, 2), 2)])
def test_streamed_output_is_identical_and_the_arena_gains_the_lent_bytes_exactly(
        arena: SlabArena, tmp_path: Path, layers: tuple[int, ...], slots: int) -> None:
    model, streamer = _streamed_toy(arena, tmp_path)
    ids = torch.tensor([1, 7, 42, 3])
    with torch.no_grad():
        before = model(ids)
    free_before = _free_slabs(arena)
    with streamer.lock:
        streamer.apply(StreamRequest(layers, slots))
    gained = (_free_slabs(arena) - free_before) * SLAB
    width = max(s.num_slabs for s in streamer.spans.values())
    lent = sum(streamer.spans[i].num_slabs for i in layers) * SLAB
    assert streamer.state.lent_bytes == lent
    assert streamer.state.slot_bytes == slots * width * SLAB
    assert gained == streamer.state.net_lent_bytes, "the table shows exactly what was lent"
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids), before), "bit-identical while streaming"
    layer_bytes = {i: streamer.spans[i].end - streamer.spans[i].start for i in layers}
    expect_last = 0 if len(layers) <= slots else sum(layer_bytes.values())
    assert streamer.state.streamed_bytes_last_pass == expect_last, (
        "each streamed layer copied once a pass; none when every one has a slot of its own")
    with streamer.lock:
        streamer.apply(StreamRequest((), slots))
    assert _free_slabs(arena) == free_before, "reversion gives every lent byte back"
    assert streamer.state.lent_bytes == 0 and streamer.state.slot_bytes == 0
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    streamer.close()


def test_without_the_copy_in_a_streamed_layer_computes_with_another_layers_weights(
        arena: SlabArena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of 'identical': S = {1, 3} through one slot, and the copy from the
    host copy skipped. Layer 3 then runs on the bytes layer 1 left in the slot, and the output
    differs: the test above would catch a streamer that maps but does not copy."""
    model, streamer = _streamed_toy(arena, tmp_path)
    ids = torch.tensor([1, 2, 9])
    with torch.no_grad():
        before = model(ids)
    with streamer.lock:
        streamer.apply(StreamRequest((1, 3), 1))
    with torch.no_grad():
        model(ids)  # the slot now holds layer 3's bytes, under layer 3
        monkeypatch.setattr(streamer, "_copy_in", lambda span: None)
        assert not torch.equal(model(ids), before)
    assert streamer._copies is not None and streamer._copies.holds == (3,), (
        "the slot sits under the last streamed layer")
    streamer.close()


def test_requests_the_model_cannot_take_are_refused_and_change_nothing(
        arena: SlabArena, tmp_path: Path) -> None:
    _, streamer = _streamed_toy(arena, tmp_path)
    free_before = _free_slabs(arena)
    with streamer.lock:
        with pytest.raises(ConfigError, match="do not exist"):
            streamer.apply(StreamRequest((4,), 1))
        with pytest.raises(ConfigError, match="at least one stays resident"):
            streamer.apply(StreamRequest((0, 1, 2, 3), 1))
    with pytest.raises(ConfigError, match="slots 3"):
        StreamRequest((1,), 3)
    with pytest.raises(ConfigError, match="repeated"):
        StreamRequest((1, 1), 1)
    assert _free_slabs(arena) == free_before and streamer.streamed == ()
    streamer.close()


def test_reversion_without_room_is_refused_and_keeps_the_layers_lent(
        arena: SlabArena, tmp_path: Path) -> None:
    model, streamer = _streamed_toy(arena, tmp_path)
    ids = torch.tensor([5, 6])
    with torch.no_grad():
        before = model(ids)
    with streamer.lock:
        streamer.apply(StreamRequest((0, 2), 1))
    filler = WeightRegion(arena.table, arena.paths.data, "filler", _free_slabs(arena) * SLAB)
    filler.back()
    with streamer.lock, pytest.raises(ArenaExhausted):
        streamer.apply(StreamRequest((), 1))
    assert streamer.streamed == (0, 2), "S as it was"
    with torch.no_grad():
        assert torch.equal(model(ids), before), "and it still computes"
    filler.close()
    with streamer.lock:
        streamer.apply(StreamRequest((), 1))
    assert streamer.streamed == ()
    streamer.close()


def test_lending_into_a_full_arena_takes_its_slot_from_the_lent_layers(
        arena: SlabArena, tmp_path: Path) -> None:
    """Regression: the first fleet run asked an idle model to lend while a neighbour's KV filled
    the arena, and the streamer refused ("2 slab(s) wanted, 0 free"): it took its slot buffer
    from the free slabs before lending. Lending is asked exactly when nothing is free."""
    model, streamer = _streamed_toy(arena, tmp_path)
    ids = torch.tensor([4, 8])
    with torch.no_grad():
        before = model(ids)
    filler = WeightRegion(arena.table, arena.paths.data, "filler", _free_slabs(arena) * SLAB)
    filler.back()
    assert _free_slabs(arena) == 0
    with streamer.lock:
        streamer.apply(StreamRequest((0, 2), 1))
    width = max(s.num_slabs for s in streamer.spans.values())
    assert _free_slabs(arena) * SLAB == streamer.state.net_lent_bytes == width * SLAB
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    filler.close()
    streamer.close()


def test_sleep_with_layers_lent_and_wake_lends_them_again(arena: SlabArena,
                                                          tmp_path: Path) -> None:
    """What the memory saver does around a sleep: the slots go back, then the rest of the
    weights; the wake restores every layer from the host copy, then S is lent again."""
    from fineslab.sglang_plugin.memory_saver import WeightSleeper

    model, streamer = _streamed_toy(arena, tmp_path)
    ids = torch.tensor([3, 1, 4])
    with torch.no_grad():
        before = model(ids)
    free_awake = _free_slabs(arena)
    sleeper = WeightSleeper(streamer.region, tmp_path / "toy.weights", host_copy_written=True)
    with streamer.lock:
        streamer.apply(StreamRequest((1, 3), 1))
        lent_free = _free_slabs(arena)
        streamer.before_sleep()
        sleeper.sleep()
    assert _free_slabs(arena) == free_awake + streamer.region.num_slabs, "every slab back"
    with streamer.lock:
        sleeper.wake()
        streamer.after_wake()
    assert streamer.streamed == (1, 3) and streamer.state.error is None
    assert _free_slabs(arena) == lent_free, "S lent again, through its slot"
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    streamer.close()


class _Mode:
    """What the streamer reads of SGLang's ForwardMode."""

    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


class _Batch:
    """What the streamer reads of SGLang's ForwardBatch."""

    def __init__(self, decode: bool) -> None:
        self.forward_mode = _Mode(decode)


def test_a_pass_is_decode_when_its_forward_batch_says_so_positional_or_by_keyword() -> None:
    ids = torch.tensor([1])
    assert is_decode((ids, ids, _Batch(True)), {})
    assert is_decode((ids, ids), {"forward_batch": _Batch(True)})
    assert not is_decode((ids, ids, _Batch(False)), {}), "a prefill (extend) pass"
    assert not is_decode((ids,), {}), "no batch: nothing is timed"


def test_decode_passes_are_timed_without_their_copies_and_prefill_passes_are_not(
        arena: SlabArena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that moves 1 s per reading: a decode pass of two streamed layers reads it six
    times (start, two copies of two readings, end): 5 s of wall, 2 s of copies, 3 s of
    compute. The moving average starts at the first pass and weighs each next one by 0.2."""
    _, streamer = _streamed_toy(arena, tmp_path)
    with streamer.lock:
        streamer.apply(StreamRequest((1, 3), 1))
    ticks = itertools.count()
    monkeypatch.setattr("fineslab.sglang_plugin.streaming.time.perf_counter",
                        lambda: float(next(ticks)))

    def one_pass(decode: bool) -> None:
        streamer.begin_pass(decode)
        for layer in range(4):
            streamer.before_layer(layer)
        streamer.end_pass()

    one_pass(decode=False)
    assert streamer.state.decode_passes == 0 and streamer.state.decode_compute_s == 0.0
    one_pass(decode=True)
    assert streamer.state.decode_passes == 1 and streamer.state.decode_compute_s == 3.0
    with streamer.lock:
        streamer.apply(StreamRequest((1,), 1))  # one layer, one slot: no copy after the first
    one_pass(decode=True)  # layer 1 into its slot: 3 s of wall, 1 s of copy, 2 s of compute
    one_pass(decode=True)  # nothing copied: start and end, 1 s
    assert streamer.state.decode_passes == 3
    after_two = 0.2 * 2.0 + 0.8 * 3.0
    assert streamer.state.decode_compute_s == pytest.approx(0.2 * 1.0 + 0.8 * after_two)
    assert streamer.state.passes == 4
    streamer.close()

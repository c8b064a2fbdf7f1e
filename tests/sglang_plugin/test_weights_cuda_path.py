"""The plugin's CUDA weight path (issue #36 item 5), as far as CPU goes: SGLang's loader call
wrapped in the runtime's region pool through the memory saver's region("weights"), the region
shrunk to what the load used, a tensor outside it or a load outside the region refused; the
sleeper's pinned host copy (opened once, every wake from it); the streamer's copy engine chosen
by the weights' device and driven before and after every layer. Real shared-memory arenas and
WeightRegions; the CUDA pieces (region_pool, PinnedHostCopy, StreamCopies) are replaced by
recording stand-ins here and run for real in test_weights_cuda_gpu.py and the staged check."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from fineslab.errors import ConfigError
from fineslab.sglang_plugin import ArenaJoin
from fineslab.sglang_plugin import streaming as streaming_module
from fineslab.sglang_plugin.cuda_weights import RegionLoad
from fineslab.sglang_plugin.hooks import PluginSession
from fineslab.sglang_plugin.memory_saver import WeightSleeper, pin_for
from fineslab.sglang_plugin.streaming import LayerStreamer, install_hooks
from fineslab.sglang_plugin.weights import move_into_region
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.integrity import check_integrity
from fineslab.slabs.layer_copy import SyncCopies, copies_for
from fineslab.slabs.streamctl import StreamRequest
from fineslab.slabs.weights import WeightRegion, free_weight_slabs

SLAB = 64 * 1024
WIDTH = 64


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = torch.nn.Linear(WIDTH, 40, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


@pytest.fixture()
def arena(tmp_path: Path) -> Iterator[SlabArena]:
    spec = ArenaSpec("cw", "cpu0", 24 * SLAB, SLAB, 64, max_runtimes=4)
    with SlabArena.create(spec, shm_dir=tmp_path) as created:
        yield created


class RecordingPool:
    """region_pool's part on CPU: while active, a `load` carves tensors from the region first
    fit (as torch's caching allocator does from the pool's segments); records its use."""

    def __init__(self, region: WeightRegion, events: list[str]) -> None:
        self.region, self.events = region, events
        self.used_bytes = 0
        self.active = False

    @contextlib.contextmanager
    def __call__(self, region: WeightRegion) -> Iterator[RecordingPool]:
        assert region is self.region
        self.events.append("pool in")
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            self.events.append("pool out")

    def take(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        at = -(-self.used_bytes // 512) * 512
        self.used_bytes = at + nbytes
        view = self.region.tensor()[at: at + nbytes].view(like.dtype).view(like.shape)
        view.copy_(like)
        return view


@dataclasses.dataclass
class Runner:
    """What the session reads of SGLang's ModelRunner."""

    model_config: Any
    device: str = "cuda"
    gpu_id: int = 0
    model: Any = None


def _session(arena: SlabArena, tmp_path: Path, events: list[str]
             ) -> tuple[PluginSession, RecordingPool, WeightRegion]:
    region = WeightRegion(arena.table, arena.paths.data, "m", 12 * SLAB)
    region.back()
    pool = RecordingPool(region, events)
    session = PluginSession(
        ArenaJoin(arena.spec.fleet_id, "m", weights_in_arena=True),
        attach_weights_arena=lambda join, device: arena,
        plan_load=lambda join, attached, model_dir: RegionLoad(region, pool, "cpu"))
    return session, pool, region


def _sglang_load(session: PluginSession, pool: RecordingPool, events: list[str],
                 inside: bool = True) -> Any:
    """SGLang 0.5.23's ModelRunner.initialize, its part here: the memory saver from the
    adapter factory, the loader call inside its region("weights")."""
    def initialize(runner: Runner) -> None:
        saver = session.memory_saver(lambda **kwargs: None)
        torch.manual_seed(0)
        model = Toy()
        with saver.region("weights") if inside else contextlib.nullcontext():
            events.append(f"load (pool active: {pool.active})")
            with torch.no_grad():
                for module in model.modules():
                    for name, param in list(module.named_parameters(recurse=False)):
                        param.data = pool.take(param.data) if pool.active else param.data
                        del name
        runner.model = model
    return initialize


def test_sglangs_load_runs_in_the_region_pool_which_then_shrinks_to_what_it_used(
        arena: SlabArena, tmp_path: Path) -> None:
    events: list[str] = []
    session, pool, region = _session(arena, tmp_path, events)
    free_before = free_weight_slabs(arena.table)
    runner = Runner(model_config=type("C", (), {"model_path": str(tmp_path)})())
    session.initialize_model(_sglang_load(session, pool, events), runner)
    assert events == ["pool in", "load (pool active: True)", "pool out"], events
    assert session.weights is region and session.weight_loads == 1
    assert region.nbytes == pool.used_bytes and region.num_slabs == -(-pool.used_bytes // SLAB)
    assert free_weight_slabs(arena.table) == free_before + 12 - region.num_slabs, \
        "the slabs the load did not touch are the arena's again"
    low, high = region.base, region.base + region.nbytes
    assert all(low <= p.data_ptr() < high for p in runner.model.parameters())
    torch.manual_seed(0)
    reference = Toy()
    ids = torch.tensor([3, 9, 27])
    with torch.no_grad():
        assert torch.equal(runner.model(ids), reference(ids)), "the loaded model computes as one"
    assert session.sleeper is not None and session.sleeper.pinned is None, "pinned only on CUDA"
    check_integrity(arena.table)
    region.close()


def test_a_load_outside_the_weights_region_or_a_tensor_outside_the_region_is_refused(
        arena: SlabArena, tmp_path: Path) -> None:
    events: list[str] = []
    session, pool, region = _session(arena, tmp_path, events)
    runner = Runner(model_config=type("C", (), {"model_path": str(tmp_path)})())
    with pytest.raises(ConfigError, match="outside the memory saver's weights region"):
        session.initialize_model(_sglang_load(session, pool, events, inside=False), runner)
    region.close()

    events = []
    session, pool, region = _session(arena, tmp_path, events)
    load = _sglang_load(session, pool, events)

    def load_then_transform(runner: Runner) -> None:
        load(runner)
        runner.model.layers[2].bias.data = torch.zeros(WIDTH)  # made after the load
    with pytest.raises(ConfigError, match=r"1 of the \d+ storages .* lie outside"):
        session.initialize_model(load_then_transform, runner)
    region.close()


class RecordingPin:
    """PinnedHostCopy's part on CPU: the host copy's bytes read once at open (pinned pages
    hold them from then on), copied into the region at each wake."""

    opened: ClassVar[list[Path]] = []

    def __init__(self, path: Path, nbytes: int) -> None:
        self.bytes = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        assert self.bytes.numel() == nbytes
        self.copies = 0
        self.closed = False
        RecordingPin.opened.append(path)

    def copy_into(self, dst: torch.Tensor) -> None:
        dst.copy_(self.bytes)
        self.copies += 1

    def close(self) -> None:
        self.closed = True


def _corrupt(path: Path) -> None:
    data = np.fromfile(path, dtype=np.uint8)
    data ^= 0x5A
    data.tofile(path)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "file-control"])
def test_the_pinned_host_copy_is_made_at_the_first_sleep_and_every_wake_reads_it(
        arena: SlabArena, tmp_path: Path, pinned: bool) -> None:
    region = WeightRegion(arena.table, arena.paths.data, "m", 3 * SLAB)
    region.back()
    saved = (torch.arange(region.nbytes) % 251).to(torch.uint8)
    region.tensor().copy_(saved)
    RecordingPin.opened = []
    path = tmp_path / "m.weights"
    sleeper = WeightSleeper(region, path, pin=RecordingPin if pinned else None)
    assert sleeper.pinned is None and not RecordingPin.opened, "nothing pinned before a sleep"
    sleeper.sleep()
    _corrupt(path)  # the file changes after the pin: a wake from the pin cannot see it
    sleeper.wake()
    assert torch.equal(region.tensor(), saved) is pinned, "pinned: the wake's bytes are the pin's"
    if not pinned:
        assert sleeper.pinned is None
        region.close()
        return
    sleeper.sleep()
    sleeper.wake()
    assert torch.equal(region.tensor(), saved)
    assert RecordingPin.opened == [path], "pinned once, at the first sleep"
    pin = sleeper.pinned
    assert pin.copies == 2, "every wake from the pinned copy"
    sleeper.close()
    assert pin.closed and sleeper.pinned is None
    region.close()


def test_a_cpu_region_wakes_from_its_file_and_is_never_pinned(arena: SlabArena) -> None:
    region = WeightRegion(arena.table, arena.paths.data, "m", SLAB)
    region.back()
    assert pin_for(region) is None
    region.close()


def test_the_copy_engine_follows_the_device_and_the_hooks_drive_it_around_each_layer(
        arena: SlabArena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(copies_for("cpu", [1, 3], 1, lambda layer: None), SyncCopies)
    calls: list[str] = []

    class Recording(SyncCopies):
        def begin_pass(self) -> None:
            calls.append("begin")

        def before_layer(self, layer: int) -> None:
            calls.append(f"before {layer}")
            super().before_layer(layer)

        def after_layer(self, layer: int) -> None:
            calls.append(f"after {layer}")

    devices: list[str] = []

    def engine(device: Any, streamed: Any, slots: int, copy: Any) -> Recording:
        devices.append(str(device))
        return Recording(streamed, slots, copy)

    monkeypatch.setattr(streaming_module, "copies_for", engine)
    torch.manual_seed(0)
    model = Toy()
    ids = torch.tensor([1, 2, 3])
    with torch.no_grad():
        expected = model(ids)

    def make(nbytes: int) -> WeightRegion:
        region = WeightRegion(arena.table, arena.paths.data, "toy", nbytes)
        region.back()
        return region

    region, moved = move_into_region(model, make, slab_bytes=SLAB)
    streamer = LayerStreamer(region, moved.layers, tmp_path / "toy.weights")
    install_hooks(streamer, model)
    with streamer.lock:
        streamer.apply(StreamRequest((1, 3), 1))
    assert devices == ["cpu"], "the engine is chosen for the weights' device"
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    assert calls == ["begin"] + [f"{w} {i}" for i in range(4) for w in ("before", "after")]
    assert streamer.copies == 2, "layers 1 and 3 take turns in one slot"
    streamer.close()
    region.close()

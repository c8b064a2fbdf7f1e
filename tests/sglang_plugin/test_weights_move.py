"""Moving a model's tensors into an arena WeightRegion (issue #16), on a small torch model with
what SGLang models hold: tied embeddings (one Parameter twice), a view sharing a storage, a
buffer, a plain tensor attribute and an int32 tensor. Real shared memory, real mmap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fineslab.sglang_plugin.weights import ALIGN, collect, move_into_region
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.weights import WeightRegion

SLAB = 64 * 1024


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 100, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("cos_sin", torch.randn(64, 16), persistent=False)
        self.scale = torch.full((32,), 0.5)  # a plain attribute, as SGLang's quant scales
        self.packed = torch.randint(-2**31, 2**31 - 1, (8, 4), dtype=torch.int32)
        self.half_view = self.proj.weight[:16]  # a view of another tensor's storage

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(ids)) * self.scale + self.cos_sin[: ids.numel(), :1].sum()
        return self.head(x) + self.packed.float().sum() * 1e-12 + self.half_view.sum()


def _inside(tensor: torch.Tensor, region: WeightRegion) -> bool:
    return region.base <= tensor.data_ptr() < region.base + region.nbytes


def test_a_moved_model_computes_the_same_and_every_tensor_lives_in_the_region(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.tensor([1, 5, 7, 99])
    before = model(ids)
    spec = ArenaSpec("wm", "cpu0", 16 * SLAB, SLAB, 64, max_runtimes=4)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        def make(nbytes: int) -> WeightRegion:
            region = WeightRegion(arena.table, arena.paths.data, "tiny", nbytes)
            region.back()
            return region

        groups = collect(model)
        # embed/head share one storage; proj.weight and half_view share one: not duplicated.
        assert len(groups) == 6, [g.nbytes for g in groups]
        region, moved = move_into_region(model, make)
        assert moved.num_storages == 6 and moved.num_tensors == 7
        assert moved.num_bytes == sum(-(-g.nbytes // ALIGN) * ALIGN for g in groups)
        assert torch.equal(model(ids), before), "bit-identical output after the move"
        for tensor in (model.embed.weight, model.proj.weight, model.proj.bias, model.cos_sin,
                       model.scale, model.packed, model.half_view):
            assert _inside(tensor, region), tensor.shape
        assert model.head.weight is model.embed.weight, "tied weights stay one Parameter"
        assert model.half_view.data_ptr() == model.proj.weight.data_ptr(), "views stay views"
        # The bytes are the arena's: change one there, see it in the model.
        slab = int(region.slab_ids[0])
        arena.tensor()[slab * SLAB] ^= 0xFF  # type: ignore[index]
        assert not torch.equal(model(ids), before)
        region.close()


def test_a_model_on_another_device_is_refused() -> None:
    model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(Exception, match="holds a meta tensor"):
        collect(model)
    with pytest.raises(Exception, match="on cuda: the model holds a meta tensor"):
        collect(model, "cuda")
    assert collect(torch.nn.Linear(2, 2), "cuda") == [], \
        "a device model's host tensors are not its device weights: left where they are"

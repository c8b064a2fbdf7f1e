"""The plugin's CUDA weight path on a GPU (issue #36 item 5), with torch models: a model built
inside its arena region through `RegionLoad` (the memory saver's region("weights") on SGLang's
loader), asleep and woken from its pinned host copy; a streamed model's layers copied on the copy
stream (`StreamCopies`, chosen by the device). SGLang itself on CUDA: the staged check's
`weights` and `streaming` stages (fineslab/gpu_lite/stage_weights.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fineslab.slabs.arena import BACKING_CUDA_VMM, ArenaSpec, SlabArena
from fineslab.slabs.integrity import check_integrity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SLAB_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class Join:
    runtime_id: str


def _arena(tmp_path: Path, num_slabs: int = 96) -> SlabArena:
    spec = ArenaSpec("cwg", "cuda:0", num_slabs * SLAB_BYTES, SLAB_BYTES, 8)
    arena = SlabArena.create(spec, shm_dir=tmp_path)
    assert arena.table.backing == BACKING_CUDA_VMM, "the driver offers virtual memory here"
    return arena


def test_a_model_loaded_in_its_region_sleeps_and_wakes_from_its_pinned_copy(
        tmp_path: Path) -> None:
    from fineslab.bench.layer_copy import build_llama
    from fineslab.sglang_plugin.cuda_weights import RegionLoad, cuda_region, load_region_bytes
    from fineslab.sglang_plugin.memory_saver import WeightSleeper, pin_for
    from fineslab.slabs.weights import PinnedHostCopy

    ids = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    with _arena(tmp_path) as arena:
        region = cuda_region(arena, "m", load_region_bytes(60 << 20))
        load = RegionLoad(region)
        with load.around_load():
            model = build_llama(512, 4, 8000, "cuda", torch.bfloat16)
        moved = load.finish(model)
        assert region.nbytes == moved.num_bytes == load.pool.used_bytes
        with torch.inference_mode():
            expected = model(ids).logits.float().cpu()
        assert pin_for(region) is PinnedHostCopy
        sleeper = WeightSleeper(region, tmp_path / "m.weights", pin=pin_for(region))
        for _ in range(2):
            sleeper.sleep()
            assert not region.backed
            sleeper.wake()
            with torch.inference_mode():
                assert torch.equal(model(ids).logits.float().cpu(), expected)
        assert sleeper.pinned is not None
        sleeper.close()
        check_integrity(arena.table)
        del model


def test_a_streamed_model_on_cuda_copies_its_layers_on_the_copy_stream(tmp_path: Path) -> None:
    from fineslab.bench.layer_copy import build_llama
    from fineslab.sglang_plugin.cuda_weights import move_into_cuda_region
    from fineslab.sglang_plugin.streaming import LayerStreamer, install_hooks
    from fineslab.slabs.layer_copy import StreamCopies
    from fineslab.slabs.streamctl import StreamRequest

    model = build_llama(512, 4, 8000, "cuda", torch.bfloat16)
    ids = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode():
        expected = model(ids).logits.float().cpu()
    with _arena(tmp_path) as arena:
        region, moved = move_into_cuda_region(Join("m"), arena, model)
        streamer = LayerStreamer(region, moved.layers, tmp_path / "m.weights")
        install_hooks(streamer, model)
        with streamer.lock:
            streamer.apply(StreamRequest((1, 3), 1))
        assert isinstance(streamer._copies, StreamCopies)
        for _ in range(3):
            with torch.inference_mode():
                assert torch.equal(model(ids).logits.float().cpu(), expected)
        assert streamer.copies == 6, "two layers take turns in one slot, every pass"
        with streamer.lock:
            streamer.apply(StreamRequest((), 1))
        with torch.inference_mode():
            assert torch.equal(model(ids).logits.float().cpu(), expected)
        streamer.close()
        check_integrity(arena.table)
        del model

"""CUDA backing (GPU only): the arena shared by CUDA IPC, views on the device, no allocation."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from slab_constants import FMT_A, FMT_B, NUM_SLABS, SLAB_BYTES

from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.views import layer_views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
_CTX = mp.get_context("spawn")
PATTERN_OFFSET = 3 * SLAB_BYTES + 17


def _runtime(shm_dir: str, queue: mp.Queue) -> None:
    arena = SlabArena.attach("gpu", "cuda:0", shm_dir=Path(shm_dir))
    tensor = arena.tensor()
    assert isinstance(tensor, torch.Tensor)
    reserved = torch.cuda.memory_reserved()
    slabs = arena.client("child", FMT_A)
    for _ in range(1000):
        slabs.free(slabs.alloc(5))
    blocks = slabs.alloc(3)
    tensor[PATTERN_OFFSET: PATTERN_OFFSET + 256] = torch.arange(256, dtype=torch.uint8,
                                                                 device=tensor.device)
    torch.cuda.synchronize()
    queue.put((blocks, torch.cuda.memory_reserved() - reserved, int(tensor[0])))
    slabs.close()
    arena.close()


def test_runtime_process_shares_the_arena_bytes(tmp_path: Path) -> None:
    spec = ArenaSpec("gpu", "cuda:0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        tensor = arena.tensor()
        assert isinstance(tensor, torch.Tensor) and tensor.is_cuda
        tensor[0] = 42
        torch.cuda.synchronize()
        queue: mp.Queue = _CTX.Queue()
        child = _CTX.Process(target=_runtime, args=(str(tmp_path), queue))
        child.start()
        blocks, reserved_growth, first_byte = queue.get(timeout=120)
        child.join(60)
        assert child.exitcode == 0
        assert first_byte == 42, "the runtime reads what the owner wrote"
        got = tensor[PATTERN_OFFSET: PATTERN_OFFSET + 256].cpu()
        assert torch.equal(got, torch.arange(256, dtype=torch.uint8)), "and the owner its writes"
        assert blocks == [0, 1, 2], "block ids from the shared table"
        assert reserved_growth == 0, "no device allocation after attach"


@pytest.mark.parametrize("fmt", [FMT_A, FMT_B], ids=["bf16", "int4"])
def test_layer_views_on_the_device_touch_only_their_bytes(tmp_path: Path, fmt: object) -> None:
    spec = ArenaSpec("gpuv", "cuda:0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
    with SlabArena.create(spec, shm_dir=tmp_path) as arena:
        tensor = arena.tensor()
        assert isinstance(tensor, torch.Tensor)
        from fineslab.slabs.formats import BlockFormat

        assert isinstance(fmt, BlockFormat)
        kv = layer_views(tensor, fmt)
        slot, layer = 9, 1
        kv[layer].v[slot].view(torch.uint8).fill_(0xFF)
        touched = torch.nonzero(tensor).flatten().cpu().tolist()
        start = slot * fmt.token_stride_bytes + layer * fmt.shape.layer_bytes + \
            fmt.shape.layer_values_bytes
        assert touched == list(range(start, start + fmt.shape.layer_values_bytes))

"""CUDA backing (GPU only): the arena shared by CUDA IPC, views on the device, no allocation."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from slab_constants import FMT_A, FMT_B, NUM_SLABS, SLAB_BYTES

from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.views import layer_views
from fineslab.slabs.weights import PinnedHostCopy, copy_file_into

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
    # The pattern is made first: its own 256 B take a 2 MiB block of torch's cache (the first
    # GPU run counted that block against the slab calls).
    pattern = torch.arange(256, dtype=torch.uint8, device=tensor.device)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    slabs = arena.client("child", FMT_A)
    for _ in range(1000):
        slabs.free(slabs.alloc(5))
    blocks = slabs.alloc(3)
    tensor[PATTERN_OFFSET: PATTERN_OFFSET + 256] = pattern
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


@pytest.mark.parametrize("chunk_bytes", [0, 3 * SLAB_BYTES // 2, 64 * SLAB_BYTES],
                         ids=["pageable", "pinned-in-chunks", "pinned-at-once"])
def test_host_copy_restores_into_device_memory(tmp_path: Path, chunk_bytes: int) -> None:
    """A wake's restore on a GPU: the host copy's bytes land in device memory, whether copied
    unpinned or pinned a chunk at a time (chunks rounded to pages, the last one short), a wrong
    size is refused, and nothing stays pinned (pinning the same pages again works)."""
    nbytes = 5 * SLAB_BYTES + 1000  # not a whole number of pages
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "weights.hostcopy"
    data.numpy().tofile(path)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    copy_file_into(path, dst, chunk_bytes=chunk_bytes)
    assert torch.equal(dst.cpu(), data)
    with pytest.raises(OSError, match="holds"):
        copy_file_into(path, dst[:-1], chunk_bytes=chunk_bytes)
    dst.zero_()
    copy_file_into(path, dst, chunk_bytes=chunk_bytes)
    assert torch.equal(dst.cpu(), data)


def test_host_copy_kept_pinned_restores_again_and_again(tmp_path: Path) -> None:
    nbytes = 5 * SLAB_BYTES + 1000
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "weights.hostcopy"
    data.numpy().tofile(path)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    with PinnedHostCopy(path, nbytes) as kept:
        for _ in range(2):
            dst.zero_()
            kept.copy_into(dst)
            assert torch.equal(dst.cpu(), data)
        with pytest.raises(OSError, match="holds"):
            kept.copy_into(dst[:-1])
    with pytest.raises(OSError, match="after close"):
        kept.copy_into(dst)
    copy_file_into(path, dst)  # unpinned at close: pinning the same pages again works
    assert torch.equal(dst.cpu(), data)

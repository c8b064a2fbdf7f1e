"""The arena on CUDA virtual memory (GPU only): shared with a runtime process through a file
descriptor, weight regions over scattered slabs at one address, lending and aliasing a layer's
slabs, and a model loaded straight into its region (cuda_vmm.py, cuda_region.py, cuda_pool.py)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from fineslab.slabs.arena import BACKING_CUDA_VMM, ArenaSpec, SlabArena
from fineslab.slabs.table import SlabState
from fineslab.slabs.weights import copy_file_into, write_host_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
_CTX = mp.get_context("spawn")
MIB = 1 << 20
SLAB_BYTES = 2 * MIB  # the mapping granularity on Hopper: the smallest slab a region can map
NUM_SLABS = 96


def _arena(tmp_path: Path) -> SlabArena:
    spec = ArenaSpec("vmm", "cuda:0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8)
    arena = SlabArena.create(spec, shm_dir=tmp_path)
    assert arena.table.backing == BACKING_CUDA_VMM, "the driver offers virtual memory here"
    return arena


def _region(arena: SlabArena, name: str, nbytes: int):  # type: ignore[no-untyped-def]
    from fineslab.slabs.cuda_region import CudaWeightRegion

    return CudaWeightRegion(arena.table, arena.backing, name, nbytes)  # type: ignore[arg-type]


def _runtime(shm_dir: str, queue: mp.Queue) -> None:
    arena = SlabArena.attach("vmm", "cuda:0", shm_dir=Path(shm_dir))
    tensor = arena.tensor()
    assert isinstance(tensor, torch.Tensor)
    first = int(tensor[5 * SLAB_BYTES + 3])
    tensor[7 * SLAB_BYTES: 7 * SLAB_BYTES + 256] = torch.arange(256, dtype=torch.uint8,
                                                                device="cuda")
    torch.cuda.synchronize()
    queue.put(first)
    arena.close()


def test_the_arena_is_shared_with_a_runtime_process(tmp_path: Path) -> None:
    with _arena(tmp_path) as arena:
        tensor = arena.tensor()
        assert isinstance(tensor, torch.Tensor) and tensor.is_cuda
        tensor[5 * SLAB_BYTES + 3] = 42
        torch.cuda.synchronize()
        queue: mp.Queue = _CTX.Queue()
        child = _CTX.Process(target=_runtime, args=(str(tmp_path), queue))
        child.start()
        first = queue.get(timeout=120)
        child.join(60)
        assert child.exitcode == 0
        assert first == 42, "the runtime reads what the owner wrote"
        got = tensor[7 * SLAB_BYTES: 7 * SLAB_BYTES + 256].cpu()
        assert torch.equal(got, torch.arange(256, dtype=torch.uint8)), "and the owner its writes"


def test_a_region_over_scattered_slabs_keeps_its_address_and_bytes(tmp_path: Path) -> None:
    with _arena(tmp_path) as arena:
        a, b, c = (_region(arena, n, 2 * SLAB_BYTES) for n in "abc")
        for r in (a, b, c):
            r.back()
        a.unback()
        c.unback()
        region = _region(arena, "model", 4 * SLAB_BYTES - 1000)
        slabs = region.back().tolist()
        assert slabs != list(range(slabs[0], slabs[0] + 4)), f"scattered slabs: {slabs}"
        base = region.base
        data = torch.randint(0, 256, (region.nbytes,), dtype=torch.uint8, device="cuda")
        region.tensor().copy_(data)
        whole = arena.tensor()
        for i, slab in enumerate(slabs):  # each position's bytes are that slab's in the arena
            size = min(SLAB_BYTES, region.nbytes - i * SLAB_BYTES)
            assert torch.equal(whole[slab * SLAB_BYTES: slab * SLAB_BYTES + size],
                               data[i * SLAB_BYTES: i * SLAB_BYTES + size])
        host = tmp_path / "model.weights"
        write_host_copy(region, host)
        region.unback()
        assert all(arena.table.state[s] == SlabState.FREE for s in slabs), "asleep: slabs free"
        b.unback()
        region.back()
        assert region.base == base, "the tensors built over the region never move"
        copy_file_into(host, region.tensor())
        assert torch.equal(region.tensor(), data), "woken: the bytes restored"
        region.close()
        b.close()


def test_a_lent_position_is_free_and_a_slot_can_show_under_it(tmp_path: Path) -> None:
    with _arena(tmp_path) as arena:
        region = _region(arena, "model", 4 * SLAB_BYTES)
        ids = region.back().tolist()
        kept = region.lend([1, 2], keep=1)
        assert kept == [ids[1]], "the slot buffer: a lent slab kept"
        assert arena.table.state[ids[2]] == SlabState.FREE, "the other lent slab is KV room"
        region.alias([2], kept)  # layer 2's range shows the slot
        region.tensor()[2 * SLAB_BYTES: 2 * SLAB_BYTES + 16] = 7
        torch.cuda.synchronize()
        assert int(arena.tensor()[kept[0] * SLAB_BYTES + 15]) == 7, "writes land in the slot"
        region.cover([2])
        region.reclaim([1, 2])
        assert region.lent_positions() == [], "reclaimed"
        owned = region.slab_ids.tolist()
        assert all(arena.table.state[s] == SlabState.FULL for s in owned)
        from fineslab.slabs.weights import release_weight_slabs

        release_weight_slabs(arena.table, region.slot, np.array(kept), "slot")
        region.close()


def test_a_model_loads_straight_into_its_region(tmp_path: Path) -> None:
    """No second copy on the device: every parameter is built in the arena's region, and the
    device's free memory outside the arena does not shrink by the model's size."""
    from fineslab.bench.layer_copy import build_llama
    from fineslab.slabs.cuda_pool import region_pool

    ids = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    reference = build_llama(512, 4, 8000, "cuda", torch.bfloat16)
    with torch.inference_mode():
        expected = reference(ids).logits.float().cpu()
    weight_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    del reference
    torch.cuda.empty_cache()
    with _arena(tmp_path) as arena:
        region = _region(arena, "model", 2 * weight_bytes)
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        with region_pool(region) as pool:
            model = build_llama(512, 4, 8000, "cuda", torch.bfloat16)
        torch.cuda.synchronize()
        grown = free_before - torch.cuda.mem_get_info()[0]
        low, high = region.base, region.base + region.span_bytes
        assert all(low <= p.data_ptr() < high for p in model.parameters()), "all in the region"
        assert pool.used_bytes >= weight_bytes
        assert grown < weight_bytes // 4, f"{grown} B allocated outside the arena"
        with torch.inference_mode():
            assert torch.equal(model(ids).logits.float().cpu(), expected), "same logits"
        del model
        pool.close()
        assert pool.live_segments == 0, "torch gave every segment back to the pool"
        region.close()


def test_streamed_layers_share_one_slot_by_address_on_the_gpu(tmp_path: Path) -> None:
    """The layer streamer's GPU design end to end, with torch alone: each decoder layer on whole
    slabs of a region, two layers lent (their ranges both showing one slot's slabs), their bytes
    copied in ahead on a copy stream through their own addresses; logits identical, the arena
    four slabs richer, and a corrupted host copy changing the logits (negative control)."""
    from fineslab.bench.layer_copy import build_llama
    from fineslab.slabs.layer_copy import StreamCopies, hook_layers

    model = build_llama(512, 4, 8000, "cuda", torch.bfloat16)
    ids = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode():
        expected = model(ids).logits.float().cpu()
    layers = model.model.layers
    layer_bytes = sum(-(-p.numel() * p.element_size() // 256) * 256
                      for p in layers[0].parameters())
    per_layer = -(-layer_bytes // SLAB_BYTES)
    with _arena(tmp_path) as arena:
        region = _region(arena, "model", len(layers) * per_layer * SLAB_BYTES)
        region.back()
        whole = region.tensor()
        for index, layer in enumerate(layers):  # each layer's tensors into its own slabs
            at = index * per_layer * SLAB_BYTES
            for p in layer.parameters():
                nbytes = p.numel() * p.element_size()
                view = whole[at: at + nbytes].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
                at += -(-nbytes // 256) * 256
        host = torch.empty(region.nbytes, dtype=torch.uint8, pin_memory=True)
        host.copy_(whole)
        free_before = int((arena.table.state == SlabState.FREE).sum())

        def positions(layer: int) -> list[int]:
            return list(range(layer * per_layer, (layer + 1) * per_layer))

        slot = region.lend(positions(1) + positions(3), keep=per_layer)
        region.alias(positions(1), slot)
        region.alias(positions(3), slot)
        assert int((arena.table.state == SlabState.FREE).sum()) == free_before + per_layer

        def copy(layer: int) -> None:
            span = slice(layer * per_layer * SLAB_BYTES, (layer + 1) * per_layer * SLAB_BYTES)
            whole[span].copy_(host[span], non_blocking=True)

        copies = StreamCopies([1, 3], 1, copy, "cuda")
        handles = hook_layers(layers, copies, model.model)
        for _ in range(3):
            with torch.inference_mode():
                assert torch.equal(model(ids).logits.float().cpu(), expected)
        assert copies.copies == 6, "two layers take turns in one slot, every pass"
        host[3 * per_layer * SLAB_BYTES: 3 * per_layer * SLAB_BYTES + 4096] = 0
        with torch.inference_mode():
            assert not torch.equal(model(ids).logits.float().cpu(), expected)
        for handle in handles:
            handle.remove()
        del model
        region.cover(positions(1) + positions(3))
        from fineslab.slabs.weights import release_weight_slabs

        release_weight_slabs(arena.table, region.slot, np.array(slot), "slot")
        region.close()

"""Weights in the arena on CUDA: SGLang's own loader builds the model inside its region (issue #36,
item 5; the CPU path moves the weights after loading, weights.py).

On a GPU the arena holds most of the device, so there is no room to load a model beside it and
move it in. Instead SGLang's load runs with every CUDA allocation routed into a
`CudaWeightRegion` of the arena (`region_pool`, slabs/cuda_pool.py). The place to do that is
SGLang's own: `load_model_with_memory_saver` (SGLang 0.5.23) wraps the loader call in
`memory_saver_adapter.region("weights")`, and the plugin's memory saver is that adapter
(memory_saver.py), so its `region("weights")` enters `RegionLoad.around_load()`:

    plan       before SGLang's ModelRunner.initialize: attach the arena (CUDA virtual memory),
               reserve and back a region of `load_region_bytes(checkpoint)` (the checkpoint's
               tensor bytes, LOAD_MARGIN, and LOAD_SLACK_BYTES for torch's segment rounding)
    load       SGLang's loader, inside region_pool(region): parameters, buffers and the load's
               temporaries are carved from the region by torch's caching allocator
    finish     after initialize: every tensor the model holds must lie in the region (a
               post-load transform that made a new tensor outside it is a ConfigError, never
               a silent copy beside the arena); the region shrinks to the load's high-water
               mark (`RegionPool.used_bytes`), its tail slabs back to the arena

    region.nbytes == pool.used_bytes after finish; every model tensor's data_ptr in
    [region.base, region.base + region.nbytes)

The pool lives as long as the model (its segments are the model's memory). Layer streaming
needs each layer on slabs of its own, which the loader's allocation order does not give, so a
streaming runtime on CUDA loads on the device and then moves into a layer-aligned region
(weights.py), which costs a transient second copy of the weights outside the arena.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.sglang_plugin.weights import MovedWeights, collect, move_into_region

logger = logging.getLogger(__name__)

#: Room for alignment in the region, as the launcher's weight slabs (fleet/plan.py).
LOAD_MARGIN = 0.02
#: torch's caching allocator asks a pool for 2 MiB segments (tensors up to 1 MiB) and 20 MiB
#: ones (1-10 MiB tensors), each partly used at the end of a load: one of each, unused at worst.
LOAD_SLACK_BYTES = 22 << 20

PoolFactory = Callable[[Any], contextlib.AbstractContextManager[Any]]


def load_region_bytes(weights_bytes: int) -> int:
    """The region a load of `weights_bytes` of checkpoint is given before it runs."""
    return int(weights_bytes * (1 + LOAD_MARGIN)) + LOAD_SLACK_BYTES


def _region_pool(region: Any) -> contextlib.AbstractContextManager[Any]:
    from fineslab.slabs.cuda_pool import region_pool

    return region_pool(region)


class RegionLoad:
    """One load of a model into `region` (backed), through `pool_factory` (module doc)."""

    def __init__(self, region: Any, pool_factory: PoolFactory = _region_pool,
                 device_type: str = "cuda") -> None:
        self.region, self.device_type = region, device_type
        self._pool_factory = pool_factory
        #: The pool the load ran in: kept while the model lives (its segments are the model's).
        self.pool: Any = None

    @contextlib.contextmanager
    def around_load(self) -> Iterator[None]:
        """SGLang's loader runs inside: every device allocation lands in the region."""
        if self.pool is not None:
            raise ConfigError(f"SGLang loaded the weights of {self.region.runtime_id!r} into "
                              "their arena region twice")
        with self._pool_factory(self.region) as pool:
            yield
        self.pool = pool
        logger.info("fineslab: SGLang loaded the weights of %r inside their arena region (%d B "
                    "used of %d B)", self.region.runtime_id, pool.used_bytes,
                    self.region.nbytes)

    def finish(self, model: Any) -> MovedWeights:
        """Check that every tensor of `model` lies in the region, then give back the slabs the
        load did not touch. ConfigError when the load did not run inside `around_load` (this
        SGLang loads outside its memory saver's weights region) or a tensor lies outside."""
        region = self.region
        if self.pool is None:
            raise ConfigError(
                f"SGLang loaded the weights of {region.runtime_id!r} outside the memory saver's "
                "weights region, so not into the arena: this SGLang version loads models "
                "differently from the one the plugin was written for")
        groups = collect(model, self.device_type)
        low, high = region.base, region.base + region.span_bytes
        outside = [g for g in groups
                   if not low <= g.tensors[0].untyped_storage().data_ptr() < high]
        if outside:
            raise ConfigError(
                f"{len(outside)} of the {len(groups)} storages of {region.runtime_id!r} "
                f"({sum(g.nbytes for g in outside)} B) lie outside its arena region: made "
                "after SGLang's load (a post-load transform); weights in the arena on CUDA "
                "cannot hold them")
        used = int(self.pool.used_bytes)
        if used <= 0:
            raise ConfigError(f"the load of {region.runtime_id!r} put nothing in its region")
        given_back = region.shrink(used)
        moved = MovedWeights(used, len(groups), sum(len(g.tensors) for g in groups))
        logger.info("fineslab: weights of %r in the arena on %s: %d B in %d slabs, %d storages "
                    "(%d tensors) in the region; %d unused slab(s) back to the arena",
                    region.runtime_id, self.device_type, used, region.num_slabs,
                    moved.num_storages, moved.num_tensors, given_back)
        return moved


def attach_cuda_arena(join: Any, device: str) -> Any:
    """The arena `join` names on CUDA `device`, attached (ConfigError when there is none, or when
    its memory is not CUDA virtual memory, the only kind weights can live in)."""
    from fineslab.slabs.arena import SlabArena
    from fineslab.slabs.cuda_vmm import VmmBacking

    try:
        arena = SlabArena.attach(join.arena_name, device)
    except FileNotFoundError as exc:
        raise ConfigError(f"no arena {join.arena_name!r} on {device} for the weights of "
                          f"{join.runtime_id!r}: the launcher creates it first ({exc})") from exc
    if not isinstance(arena.backing, VmmBacking):
        arena.close()
        raise ConfigError(f"the arena {join.arena_name!r} on {device} is not CUDA virtual "
                          "memory (the driver refused it at creation): weights cannot live in it")
    return arena


def cuda_region(arena: Any, runtime_id: str, nbytes: int) -> Any:
    """A backed `CudaWeightRegion` of `nbytes` in `arena` (ConfigError when it does not fit)."""
    from fineslab.slabs.cuda_region import CudaWeightRegion

    region = CudaWeightRegion(arena.table, arena.backing, runtime_id, nbytes)
    try:
        region.back()
    except ArenaExhausted as exc:
        region.close()
        raise ConfigError(f"the weights of {runtime_id!r} ({nbytes} B, {region.num_slabs} "
                          f"slabs) do not fit the arena on {arena.spec.device}: {exc}") from exc
    return region


def plan_region_load(join: Any, arena: Any, model_dir: Path) -> RegionLoad:
    """The load of the checkpoint at `model_dir` into a new region of `arena` (CUDA)."""
    from fineslab.models.checkpoint import safetensors_bytes_and_params

    nbytes = load_region_bytes(safetensors_bytes_and_params(model_dir)[0])
    return RegionLoad(cuda_region(arena, join.runtime_id, nbytes))


def move_into_cuda_region(join: Any, arena: Any, model: Any) -> tuple[Any, MovedWeights]:
    """A model loaded on the device moved into a new region of `arena`, each decoder layer on
    slabs of its own (layer streaming; the transient second copy of the module doc)."""
    import torch

    moved = move_into_region(model, lambda nbytes: cuda_region(arena, join.runtime_id, nbytes),
                             arena.spec.slab_bytes, "cuda")
    torch.cuda.empty_cache()  # the loader's copy, freed by the move, back to the device
    return moved

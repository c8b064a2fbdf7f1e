"""Moving a loaded model's tensors into a `WeightRegion` of the arena (issue #16).

After SGLang has loaded the model (and run its post-load transforms), every tensor the model
holds is moved, storage by storage, into one region of whole arena slabs:

    1. collect: walk `named_modules(remove_duplicate=False)`; take each module's parameters,
       buffers and plain tensor attributes (SGLang keeps some, e.g. rotary caches and quantized
       scales, as attributes); group them by storage (`untyped_storage().data_ptr()`): tied
       embeddings and views share one storage and must keep sharing it;
    2. lay out: one range per storage, in walk order, each aligned to ALIGN bytes;
    3. move: copy each storage's bytes to its range, then point every tensor of the storage
       at the same size, stride and offset within the range (`t.data = ...`: the Python
       objects the model and SGLang hold stay the same objects).

Afterwards the loader's copies have no references left and are freed. Outputs are bit-identical
(the bytes are), which the plugin tests check against the stock runtime.

    region bytes == sum over storages of align_up(storage nbytes, ALIGN)
    every tensor of the model: data_ptr() inside the region

Only CPU tensors (the CUDA path is not built: it must place weights at load time, without a
second full copy). Cost: one memcpy of the weights (4-18 ms for the tiny models).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fineslab.errors import ConfigError

logger = logging.getLogger(__name__)

#: Alignment of each storage in the region (a cache line; any dtype's element size divides it).
ALIGN = 64


@dataclass
class StorageGroup:
    """One storage of the model and every tensor that views it."""

    nbytes: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    offset: int = 0  # in the region, set by `layout`


def _tensors_of(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    for _, module in model.named_modules(remove_duplicate=False):
        yield from (p for p in module._parameters.values() if p is not None)
        yield from (b for b in module._buffers.values() if b is not None)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                yield value


def collect(model: torch.nn.Module) -> list[StorageGroup]:
    """The model's storages in walk order, each with the tensors that view it (each once)."""
    groups: dict[int, StorageGroup] = {}
    seen: set[int] = set()
    for tensor in _tensors_of(model):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.device.type != "cpu":
            raise ConfigError(f"weights in the arena: a {tensor.device} tensor; only CPU "
                              "weights can be moved after loading (the CUDA path is not built)")
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        group = groups.setdefault(storage.data_ptr(), StorageGroup(storage.nbytes()))
        group.tensors.append(tensor)
    return list(groups.values())


def layout(groups: list[StorageGroup]) -> int:
    """Give each storage its offset; returns the region's size in bytes."""
    offset = 0
    for group in groups:
        group.offset = offset
        offset += -(-group.nbytes // ALIGN) * ALIGN
    return offset


def move(groups: list[StorageGroup], region: torch.Tensor) -> None:
    """Copy each storage into `region` (uint8) at its offset and re-point its tensors there."""
    with torch.no_grad():
        for group in groups:
            dst = region[group.offset: group.offset + group.nbytes]
            source = group.tensors[0].untyped_storage()
            dst.copy_(torch.empty(0, dtype=torch.uint8).set_(source))
            for tensor in group.tensors:
                typed = dst.view(tensor.dtype)
                # as_strided's offset counts from the region's start, not from `typed`'s.
                tensor.data = torch.as_strided(typed, tensor.size(), tensor.stride(),
                                               typed.storage_offset() + tensor.storage_offset())


@dataclass(frozen=True)
class MovedWeights:
    num_bytes: int
    num_storages: int
    num_tensors: int


def move_into_region(model: torch.nn.Module,
                     make_region: Callable[[int], Any]) -> tuple[Any, MovedWeights]:
    """Collect, lay out, ask `make_region(nbytes)` for a backed region (with `tensor()`), move.
    Returns the region and what was moved."""
    groups = collect(model)
    nbytes = layout(groups)
    region = make_region(nbytes)
    move(groups, region.tensor())
    moved = MovedWeights(nbytes, len(groups), sum(len(g.tensors) for g in groups))
    logger.info("weights in the arena: %d B in %d storages (%d tensors)", moved.num_bytes,
                moved.num_storages, moved.num_tensors)
    return region, moved


def place_weights(join: Any, model: torch.nn.Module, device: str) -> Any:
    """The runtime's weights into a `WeightRegion` of the arena `join` names on `device`.

    Raises ConfigError (the runtime stops at start) when there is no such arena or it has too
    few free slabs: a runtime told to keep its weights in the arena never keeps them elsewhere.
    """
    from fineslab.errors import ArenaExhausted
    from fineslab.slabs.shm import ArenaPaths
    from fineslab.slabs.table import SlabTable
    from fineslab.slabs.weights import WeightRegion

    paths = ArenaPaths.of(join.arena_name, device)
    try:
        table = SlabTable.open(paths.table)
    except FileNotFoundError as exc:
        raise ConfigError(f"no arena {join.arena_name!r} on {device} for the weights of "
                          f"{join.runtime_id!r}: the launcher creates it first ({exc})") from exc

    def make_region(nbytes: int) -> WeightRegion:
        region = WeightRegion(table, paths.data, join.runtime_id, nbytes)
        try:
            region.back()
        except ArenaExhausted as exc:
            region.close()
            raise ConfigError(f"the weights of {join.runtime_id!r} ({nbytes} B, "
                              f"{region.num_slabs} slabs) do not fit the arena on {device}: "
                              f"{exc}") from exc
        return region

    region, _ = move_into_region(model, make_region)
    return region

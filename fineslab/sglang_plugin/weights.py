"""Moving a loaded model's tensors into a `WeightRegion` of the arena (issue #16).

After SGLang has loaded the model (and run its post-load transforms), every tensor the model
holds is moved, storage by storage, into one region of whole arena slabs:

    1. collect: walk `named_modules(remove_duplicate=False)`; take each module's parameters,
       buffers and plain tensor attributes (SGLang keeps some, e.g. rotary caches and quantized
       scales, as attributes); group them by storage (`untyped_storage().data_ptr()`): tied
       embeddings and views share one storage and must keep sharing it;
    2. lay out: one range per storage, in walk order, each aligned to ALIGN bytes; for layer
       streaming (`slab_bytes` given, issue #17) the storages of decoder layer i (module
       `...layers.i`) come after the others, and each layer starts on a slab boundary, so
       that a layer's bytes are whole slabs of its own (`LayerSpan`) which can be lent;
    3. move: copy each storage's bytes to its range, then point every tensor of the storage
       at the same size, stride and offset within the range (`t.data = ...`: the Python
       objects the model and SGLang hold stay the same objects).

Afterwards the loader's copies have no references left and are freed. Outputs are bit-identical
(the bytes are), which the plugin tests check against the stock runtime.

    region bytes == sum over storages of align_up(storage nbytes, ALIGN)
    every tensor of the model: data_ptr() inside the region

On CPU, the runtime's path. On CUDA, a runtime that streams layers takes it too (its layers
need slabs of their own), at the cost of a transient second copy on the device; every other
CUDA runtime has SGLang's loader build the model inside its region (cuda_weights.py). Cost: one
copy of the weights (4-18 ms for the tiny models on CPU).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fineslab.errors import ConfigError

logger = logging.getLogger(__name__)

#: Alignment of each storage in the region (a cache line; any dtype's element size divides it).
ALIGN = 64
#: A decoder layer's module name: `model.layers.3`, `layers.0` (the index is the layer's).
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)$")
#: Not part of one decoder layer (embeddings, final norm, a storage two layers share).
SHARED = -1


@dataclass
class StorageGroup:
    """One storage of the model and every tensor that views it."""

    nbytes: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    offset: int = 0  # in the region, set by `layout`
    layer: int = SHARED  # the decoder layer all its tensors belong to


@dataclass(frozen=True)
class LayerSpan:
    """Decoder layer `layer`'s bytes in the region: [start, end), in slabs [first_slab,
    first_slab + num_slabs) that hold nothing else."""

    layer: int
    start: int
    end: int
    first_slab: int
    num_slabs: int

    @property
    def slabs(self) -> range:
        return range(self.first_slab, self.first_slab + self.num_slabs)


def _layer_names(model: torch.nn.Module) -> dict[str, int]:
    """The decoder layers' module names (`model.layers.3`) with their index; the first module
    list named `layers` that has an index wins it."""
    names: dict[str, int] = {}
    for name, _ in model.named_modules():
        found = _LAYER_NAME.search(name)
        if found and int(found.group(1)) not in names.values():
            names[name] = int(found.group(1))
    return names


def decoder_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's decoder layers by index (modules named `...layers.<i>`)."""
    return {i: model.get_submodule(name) for name, i in _layer_names(model).items()}


def layers_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose `layers` list holds the decoder layers (Llama's `model.model`): it runs
    once per forward pass, through `__call__` (SGLang calls the root's `forward` directly, so
    hooks on the root would not fire)."""
    names = _layer_names(model)
    if not names:
        return model
    first = min(names, key=names.__getitem__)
    prefix = first.rsplit(".", 2)[0] if first.count(".") >= 2 else ""
    return model.get_submodule(prefix) if prefix else model


def _layer_of(name: str, layer_names: dict[str, int]) -> int:
    """The decoder layer the module called `name` is in (itself or an ancestor), or SHARED."""
    parts = name.split(".")
    while parts:
        layer = layer_names.get(".".join(parts))
        if layer is not None:
            return layer
        parts.pop()
    return SHARED


def _tensors_of(model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, int]]:
    """Every tensor the model holds, with the decoder layer whose module holds it (or SHARED)."""
    layer_names = _layer_names(model)
    for name, module in model.named_modules(remove_duplicate=False):
        layer = _layer_of(name, layer_names) if name else SHARED
        yield from ((p, layer) for p in module._parameters.values() if p is not None)
        yield from ((b, layer) for b in module._buffers.values() if b is not None)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                yield value, layer


def collect(model: torch.nn.Module, device_type: str = "cpu") -> list[StorageGroup]:
    """The model's storages in walk order, each with the tensors that view it (each once) and
    the decoder layer they belong to: SHARED unless every module holding any of its tensors is
    in that one layer (SGLang shares one rotary-embedding module among all layers). A tensor on
    another device than `device_type` is a ConfigError (the region is on one device), except
    host tensors of a device model, which are not collected (they are not device weights)."""
    groups: dict[int, StorageGroup] = {}
    group_of: dict[int, StorageGroup] = {}
    for tensor, layer in _tensors_of(model):
        group = group_of.get(id(tensor))
        if group is not None:
            if group.layer != layer:
                group.layer = SHARED
            continue
        if tensor.device.type != device_type:
            if device_type != "cpu" and tensor.device.type == "cpu":
                continue  # a device model's host-side tensors (index tables) stay in host memory
            raise ConfigError(f"weights in the arena on {device_type}: the model holds a "
                              f"{tensor.device} tensor, which its region cannot hold")
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        group = groups.get(storage.data_ptr())
        if group is None:
            group = groups[storage.data_ptr()] = StorageGroup(storage.nbytes(), layer=layer)
        elif group.layer != layer:
            group.layer = SHARED  # viewed from two layers (or a layer and the rest)
        group.tensors.append(tensor)
        group_of[id(tensor)] = group
    return list(groups.values())


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def layout(groups: list[StorageGroup], slab_bytes: int | None = None) -> int:
    """Give each storage its offset; returns the region's size in bytes. With `slab_bytes`,
    the layers' storages go last, each layer from a slab boundary (module doc)."""
    offset = 0
    placed = groups if slab_bytes is None else [g for g in groups if g.layer == SHARED]
    for group in placed:
        group.offset = offset
        offset += _align(group.nbytes, ALIGN)
    if slab_bytes is None:
        return offset
    for layer in sorted({g.layer for g in groups} - {SHARED}):
        offset = _align(offset, slab_bytes)
        for group in (g for g in groups if g.layer == layer):
            group.offset = offset
            offset += _align(group.nbytes, ALIGN)
    return offset


def layer_spans(groups: list[StorageGroup], slab_bytes: int) -> list[LayerSpan]:
    """Each decoder layer's span after `layout(groups, slab_bytes)`, by layer index."""
    spans = []
    for layer in sorted({g.layer for g in groups} - {SHARED}):
        mine = [g for g in groups if g.layer == layer]
        start = min(g.offset for g in mine)
        end = max(g.offset + g.nbytes for g in mine)
        first = start // slab_bytes
        spans.append(LayerSpan(layer, start, end, first, -(-end // slab_bytes) - first))
    return spans


def move(groups: list[StorageGroup], region: torch.Tensor) -> None:
    """Copy each storage into `region` (uint8) at its offset and re-point its tensors there."""
    with torch.no_grad():
        for group in groups:
            dst = region[group.offset: group.offset + group.nbytes]
            source = group.tensors[0].untyped_storage()
            dst.copy_(torch.empty(0, dtype=torch.uint8, device=source.device).set_(source))
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
    #: Each decoder layer's whole slabs (laid out for streaming), else empty.
    layers: tuple[LayerSpan, ...] = ()


def move_into_region(model: torch.nn.Module, make_region: Callable[[int], Any],
                     slab_bytes: int | None = None, device_type: str = "cpu"
                     ) -> tuple[Any, MovedWeights]:
    """Collect, lay out (layers on slab boundaries with `slab_bytes`), ask `make_region(nbytes)`
    for a backed region (with `tensor()`), move. Returns the region and what was moved."""
    groups = collect(model, device_type)
    nbytes = layout(groups, slab_bytes)
    region = make_region(nbytes)
    move(groups, region.tensor())
    spans = tuple(layer_spans(groups, slab_bytes)) if slab_bytes else ()
    moved = MovedWeights(nbytes, len(groups), sum(len(g.tensors) for g in groups), spans)
    logger.info("weights in the arena: %d B in %d storages (%d tensors)%s", moved.num_bytes,
                moved.num_storages, moved.num_tensors,
                f"; {len(spans)} layers on slab boundaries" if spans else "")
    return region, moved


def place_weights(join: Any, model: torch.nn.Module, device: str
                  ) -> tuple[Any, MovedWeights]:
    """The runtime's weights into a `WeightRegion` of the arena `join` names on `device` (CPU;
    CUDA: `cuda_weights.move_into_cuda_region`), each decoder layer on whole slabs of its own
    when `join.layer_streaming`.

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

    slab_bytes = table.dims.slab_bytes if join.layer_streaming else None
    return move_into_region(model, make_region, slab_bytes)

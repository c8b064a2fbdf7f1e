"""ArenaLink: one runtime's attachment to its device's arena (the only caller of fineslab.slabs'
attach path inside SGLang processes).

Joining means: attach the arena by fleet id and device, fit this model's KV shape to the arena's
slab size at SGLang's page size (the same `fit_format` the launcher's slab plan used, so both
sides agree on the padded token stride), register with the slab table, and build the per-layer
views. Anything that does not fit is a start-up ConfigError naming the numbers.

Capacity (what SGLang is told it has, in tokens):
    num_slots       = arena_bytes // token_stride_bytes  (a multiple of tokens_per_block)
    padding_slots   = blocks_per_slab * tokens_per_block  (slab 0, the padding slab)
    capacity_tokens = num_slots - padding_slots
SGLang's views have num_slots >= capacity_tokens + page_size rows, so every block id of the
format (0 .. num_slots / tokens_per_block - 1) is a valid SGLang page id; the pages of slab 0
take SGLang's padded-token writes and `SlabAllocator` never hands them out (allocator.py says
why the whole slab).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.sglang_plugin.allocator import BlockSource
from fineslab.sglang_plugin.config import ArenaJoin
from fineslab.slabs.arena import SlabArena
from fineslab.slabs.formats import BlockFormat, KVShape
from fineslab.slabs.shm import ArenaPaths
from fineslab.slabs.sizing import fit_format
from fineslab.slabs.table import SlabTable
from fineslab.slabs.views import LayerKV, layer_views

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArenaLink:
    """What a runtime holds while it is a member of an arena."""

    arena: SlabArena
    fmt: BlockFormat
    views: Sequence[LayerKV]
    source: BlockSource

    @property
    def num_slots(self) -> int:
        return self.arena.spec.arena_bytes // self.fmt.token_stride_bytes

    @property
    def padding_slots(self) -> int:
        return self.fmt.blocks_per_slab(self.arena.spec.slab_bytes) * self.fmt.tokens_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots - self.padding_slots

    def page_bytes(self) -> Any:
        """The arena as [pages, block_stride_bytes] uint8 rows: page p is row p."""
        num_pages = self.num_slots // self.fmt.tokens_per_block
        stride = self.fmt.block_stride_bytes
        arena: Any = self.arena.tensor()
        return arena[: num_pages * stride].view(num_pages, stride)


def fit_to_arena(shape: KVShape, slab_bytes: int, arena_bytes: int, page_size: int) -> BlockFormat:
    """This model's block format in an arena, or ConfigError saying why there is none."""
    fmt = fit_format(shape, slab_bytes, [page_size])
    if fmt is None:
        raise ConfigError(
            f"unknown model format: no {page_size}-token block of {shape.name!r} "
            f"({shape.token_bytes} B a token) divides the arena's {slab_bytes} B slabs; plan "
            "the arena with this model and page size (fineslab.slabs.sizing.plan_slabs)")
    check_arena_room(arena_bytes, slab_bytes, shape.name)
    return fmt


def check_arena_room(arena_bytes: int, slab_bytes: int, runtime_id: str) -> None:
    """ConfigError unless the arena has a slab for KV besides slab 0 (the padding slab)."""
    if arena_bytes < 2 * slab_bytes:
        raise ConfigError(
            f"arena too small: {arena_bytes} B is fewer than two {slab_bytes} B slabs (slab 0 "
            f"takes SGLang's padded-token writes and holds no KV), so no block of "
            f"{runtime_id!r} is left for KV")


def check_arena_before_start(join: ArenaJoin, device: str) -> None:
    """What a launching process can tell of the arena `join` names before SGLang starts the
    runtime's scheduler: that it exists and has room for KV. Reads the slab table's header only
    (the arena's data is never mapped, so a CUDA arena costs that process no CUDA context); the
    model's format is the scheduler's to check (`fit_to_arena`), with SGLang's model config."""
    paths = ArenaPaths.of(join.arena_name, device)
    try:
        table = SlabTable.open(paths.table, writable=False)
    except EnvironmentSetupError as exc:
        raise ConfigError(
            f"no arena {join.arena_name!r} on {device}: the launcher creates it before starting "
            f"runtimes ({exc})") from exc
    try:
        dims = table.dims
    finally:
        table.close()
    check_arena_room(dims.num_slabs * dims.slab_bytes, dims.slab_bytes, join.runtime_id)


def join_arena(join: ArenaJoin, shape: KVShape, page_size: int, device: str,
               arena: SlabArena | None = None) -> ArenaLink:
    """Attach to the arena `join` names on `device` (or use `arena`, attached already for the
    weights: a CUDA arena is imported and mapped once per process) and register this runtime
    in its table."""
    if arena is None:
        try:
            arena = SlabArena.attach(join.arena_name, device)
        except FileNotFoundError as exc:
            raise ConfigError(
                f"no arena {join.arena_name!r} on {device}: the launcher creates it before "
                f"starting runtimes ({exc})") from exc
    try:
        fmt = fit_to_arena(shape, arena.spec.slab_bytes, arena.spec.arena_bytes, page_size)
        join.check_block(fmt)  # the launcher's plan (runtime contract), before any slab is ours
        views = layer_views(arena.tensor(), fmt)  # type: ignore[arg-type]
        source = arena.client(join.runtime_id, fmt, pooled=join.key_pool)
    except BaseException:
        arena.close()
        raise
    logger.info("fineslab: %r format: %d B token (stride %d B), %d blocks a slab%s",
                join.runtime_id, fmt.token_bytes, fmt.token_stride_bytes,
                fmt.blocks_per_slab(arena.spec.slab_bytes),
                ", key pool shared with same-size runtimes" if join.key_pool else "")
    return ArenaLink(arena, fmt, views, source)

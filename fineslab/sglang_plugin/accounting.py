"""Live KV memory per model, read from the shared slab table (for the router and the launcher).

Nothing here talks to SGLang: every runtime's allocator writes its block counts into the slab
table as it allocates, so an observer opens the table read-only and reads them, lock-free, at
any rate it likes. The counts of a runtime that is allocating at that moment may be a step old;
they are exact for an idle runtime.

    used_bytes     = used_blocks * block_stride_bytes      (blocks SGLang holds, incl. page 0)
    held_bytes     = num_slabs * slab_bytes                (slabs carved for the model; in a
                                                            key pool, the slabs holding its
                                                            blocks, shared with the pool)
    tokens_cached  = used_blocks * tokens_per_block        (when the caller knows the page size)
    free_bytes     = free slabs * slab_bytes               (what any model could still get)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.slabs import ArenaPaths, SlabTable, snapshot


@dataclass(frozen=True)
class ModelMemory:
    """One runtime's share of the arena."""

    runtime_id: str
    alive: bool
    num_slabs: int
    used_blocks: int
    used_bytes: int
    held_bytes: int
    tokens_cached: int | None


@dataclass(frozen=True)
class ArenaMemory:
    """The whole arena: its size, its free space and each runtime's share."""

    arena_bytes: int
    free_bytes: int
    models: tuple[ModelMemory, ...]

    def of(self, runtime_id: str) -> ModelMemory | None:
        """The live entry of `runtime_id`, or None if it holds no registry slot."""
        for model in self.models:
            if model.runtime_id == runtime_id and model.alive:
                return model
        return None


def memory_of(table: SlabTable, tokens_per_block: Mapping[str, int] | None = None
              ) -> ArenaMemory:
    """Read an open table; `tokens_per_block` maps runtime ids to their page sizes."""
    snap = snapshot(table)
    pages = tokens_per_block or {}
    models = tuple(
        ModelMemory(o.runtime_id, o.alive, o.num_slabs, o.used_blocks, o.used_bytes,
                    o.num_slabs * snap.slab_bytes,
                    o.used_blocks * pages[o.runtime_id] if o.runtime_id in pages else None)
        for o in snap.owners)
    return ArenaMemory(snap.num_slabs * snap.slab_bytes, snap.free_bytes, models)


def read_memory(fleet_id: str, device: str, tokens_per_block: Mapping[str, int] | None = None,
                shm_dir: Path | None = None) -> ArenaMemory:
    """Open the arena's table of `fleet_id` on `device` read-only, read it, close it."""
    path = ArenaPaths.of(fleet_id, device, shm_dir).table
    try:
        table = SlabTable.open(path, writable=False)
    except FileNotFoundError as exc:
        raise ConfigError(f"no arena {fleet_id!r} on {device} ({path})") from exc
    try:
        return memory_of(table, tokens_per_block)
    finally:
        table.close()

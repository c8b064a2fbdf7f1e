"""KV accounting of the simulated fleet through the real slab table (fineslab.slabs).

Every simulated GPU gets a real `SlabTable` (a small shared-memory file; no arena bytes are
allocated, the simulator only counts blocks) and every model replica a real `RuntimeSlabs` on
it, so the simulator's memory behaviour is the allocator's, not a model of it.

    shared ("slab")    one table per GPU sized to the GPU's KV space; every resident carves
                       slabs from it on demand (fineslab and Prism*)
    static             one table per (replica, GPU) sized to the replica's fixed partition
                       (Static*): a replica can never use another's free memory
    pages              no slab table: one pool of 2 MB pages per GPU sized to the same KV space,
                       each replica rank a `PageLease` on it (kvcached; see `sim.pages`)

Sizes, per GPU g with residents R(g) (bytes):

    kv_space(g)   = memory(g) - sum_{r in R(g)} (weights_r + activation_r)        shared
    kv_space(r,g) = partition(r) - weights_r - activation_r                        static
    num_slabs     = floor(kv_space / slab_bytes)

A TP replica holds a `ReplicaKv` with one lease per GPU of its group and allocates the same
number of blocks on each, all or none. Invariant (checked by tests after every event):
    sum over leases of used blocks * block_stride_bytes <= num_slabs * slab_bytes   per table
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.sim.config import SimConfig
from fineslab.sim.pages import GpuPagePool, PageLease
from fineslab.slabs import (
    BlockFormat,
    KVDtype,
    KVShape,
    RuntimeSlabs,
    SlabPlan,
    SlabTable,
    plan_slabs,
)
from fineslab.slabs.integrity import check_integrity
from fineslab.slabs.table import TableDims

logger = logging.getLogger(__name__)

_BACKING_NONE = 0
#: A replica rank's block lease: a slab runtime, or a kvcached page lease (`sim.pages`).
LeaseT = TypeVar("LeaseT", RuntimeSlabs, PageLease)


def kv_shape(name: str, profile: ModelProfile) -> KVShape:
    """The slab allocator's view of a profiled model (one TP rank)."""
    try:
        dtype = KVDtype.from_name(profile.kv_dtype)
    except ConfigError as exc:
        raise ConfigError(f"{name}: no slab format: {exc}") from None
    s = profile.shape
    return KVShape(name, s.num_layers, s.num_kv_heads, s.head_dim, dtype, profile.tp)


class ReplicaKv(Generic[LeaseT]):
    """One replica's block leases, one per GPU of its group (all-or-none allocation)."""

    def __init__(self, leases: Sequence[LeaseT]) -> None:
        self.leases: tuple[LeaseT, ...] = tuple(leases)
        self.tokens_per_block = leases[0].fmt.tokens_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.tokens_per_block)

    @property
    def capacity_blocks(self) -> int:
        """Blocks this replica could hold with every slab it may reach (a whole table)."""
        return min(lease.num_blocks_total for lease in self.leases)

    def available_blocks(self) -> int:
        return min(lease.available_blocks() for lease in self.leases)

    def try_alloc(self, num_blocks: int) -> list[list[int]] | None:
        """Block ids per lease, or None (nothing held) when some GPU is short."""
        if self.available_blocks() < num_blocks:
            return None
        taken: list[list[int]] = []
        try:
            for lease in self.leases:
                taken.append(lease.alloc(num_blocks))
        except ArenaExhausted:
            for lease, ids in zip(self.leases, taken, strict=False):
                lease.free(ids)
            return None
        return taken

    def free(self, blocks: list[list[int]]) -> None:
        for lease, ids in zip(self.leases, blocks, strict=True):
            lease.free(ids)

    def used_blocks(self) -> int:
        return self.leases[0].num_used_blocks()

    def settle_step(self) -> float:
        """Seconds of page mapping the step about to start owes: 0 on slabs; on kvcached's
        pages the slowest rank's (a TP group's ranks map in parallel)."""
        return max((lease.settle_step() for lease in self.leases
                    if isinstance(lease, PageLease)), default=0.0)


@dataclass(frozen=True)
class GpuKvPlan:
    """What one GPU's memory holds for KV: its slab plan and each resident's KV bytes."""

    gpu_id: int
    slab_plan: SlabPlan
    shared_kv_bytes: int  # used in shared mode
    partition_kv_bytes: dict[str, int]  # used in static mode, by resident key


class FleetKv:
    """The tables and leases of a whole simulated fleet; `close()` removes the files."""

    def __init__(self, shm_dir: Path | None = None, config: SimConfig | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="fineslab-sim-", dir=shm_dir or _shm()))
        self.config = config or SimConfig()
        self.tables: list[SlabTable] = []
        self.pools: dict[int, GpuPagePool] = {}
        self._leases: list[RuntimeSlabs | PageLease] = []
        self._shared: dict[int, SlabTable] = {}

    def _table(self, label: str, kv_bytes: int, slab_plan: SlabPlan) -> SlabTable:
        num_slabs = kv_bytes // slab_plan.slab_bytes
        if num_slabs < 1:
            raise ConfigError(f"{label}: {kv_bytes} B of KV space holds no slab of "
                              f"{slab_plan.slab_bytes} B")
        dims = TableDims(num_slabs, slab_plan.slab_bytes, slab_plan.max_blocks_per_slab)
        table = SlabTable.create(self.folder / f"{label}.table", dims, _BACKING_NONE)
        self.tables.append(table)
        return table

    def lease(self, gpu: GpuKvPlan, key: str, model: str,
              kv_mode: str) -> RuntimeSlabs | PageLease:
        """The block lease of replica `key` (model `model`) on `gpu` in `kv_mode`."""
        fmt = gpu.slab_plan.format_of(model)
        if kv_mode == "pages":
            return self._page_lease(gpu, key, fmt)
        if kv_mode == "static":
            table = self._table(f"g{gpu.gpu_id}-{_safe(key)}", gpu.partition_kv_bytes[key],
                                gpu.slab_plan)
        else:
            if gpu.gpu_id not in self._shared:
                self._shared[gpu.gpu_id] = self._table(f"g{gpu.gpu_id}", gpu.shared_kv_bytes,
                                                       gpu.slab_plan)
            table = self._shared[gpu.gpu_id]
        slabs = RuntimeSlabs(table, _safe(key), fmt)
        self._leases.append(slabs)
        return slabs

    def shared_table(self, gpu_id: int) -> SlabTable | None:
        """The shared slab table of `gpu_id` (None: none there, as in static mode)."""
        return self._shared.get(gpu_id)

    def _page_lease(self, gpu: GpuKvPlan, key: str, fmt: BlockFormat) -> PageLease:
        """kvcached: the GPU's page pool holds the KV space the shared slab table would."""
        if gpu.gpu_id not in self.pools:
            self.pools[gpu.gpu_id] = GpuPagePool(gpu.gpu_id, gpu.shared_kv_bytes)
        cfg = self.config
        lease = PageLease(self.pools[gpu.gpu_id], _safe(key), fmt,
                          map_s_per_page=cfg.page_map_s + cfg.page_set_access_s,
                          min_reserve=cfg.page_reserve_min, max_reserve=cfg.page_reserve_max)
        self._leases.append(lease)
        return lease

    def check_integrity(self) -> None:
        for table in self.tables:
            check_integrity(table)
        for pool in self.pools.values():
            pool.check_integrity()
        for lease in self._leases:
            lease.check_integrity()

    def close(self) -> None:
        for lease in self._leases:
            lease.close()
        for table in self.tables:
            table.close()
        self._leases, self.tables, self.pools = [], [], {}
        shutil.rmtree(self.folder, ignore_errors=True)


def gpu_slab_plan(models: dict[str, ModelProfile], min_slab_bytes: int) -> SlabPlan:
    """The slab size and block formats of one GPU's residents (model name -> profile)."""
    shapes = [kv_shape(name, profile) for name, profile in sorted(models.items())]
    return plan_slabs(shapes, min_slab_bytes=min_slab_bytes,
                      max_slab_bytes=max(min_slab_bytes, 256 << 20))


def _safe(key: str) -> str:
    return key.replace("#", "_").replace("/", "_")[:64]


def _shm() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())

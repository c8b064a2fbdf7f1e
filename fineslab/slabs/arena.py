"""SlabArena: the one byte tensor of a device plus its slab table, created once at start.

The launcher (the owner) calls `SlabArena.create(spec)`; runtimes call `SlabArena.attach(fleet_id,
device)` and get the same bytes and the same table. No allocation, mapping or driver call happens
after that: blocks are handed out by `RuntimeSlabs` from the table alone.

Backings (one interface, `ArenaBacking`):
    CPU   a shared-memory file /dev/shm/fineslab-<fleet>-<device>.arena (0600), mapped by every
          process; tmpfs commits pages on first touch.
    CUDA  CUDA virtual memory, one exported allocation per slab, whose descriptors the owner
          serves on a unix socket at the data path (no data file on CUDA) and each runtime
          imports and maps once (cuda_vmm.py); weight regions map its slabs too
          (cuda_region.py). Where the driver refuses that,
          one `torch.empty` shared by CUDA IPC (cuda_backing.py), KV only.

Lifecycle: the creator's `close()` unlinks both files (clean shutdown). A file left by a crashed
creator is found at the next `create`: if its creator process is gone it is reclaimed (unlinked
and created afresh, with a warning), unless `reclaim_stale=False`, which refuses; if the creator
is alive, `create` refuses (EnvironmentSetupError): two fleets cannot share a name.

Invariant: arena_bytes == num_slabs * slab_bytes; slab s spans [s * slab_bytes, (s+1) * slab_bytes).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.proctree import ProcessIdentity, default_shm_dir
from fineslab.slabs.client import RuntimeSlabs
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.pooled import PooledSlabs
from fineslab.slabs.shm import (
    ArenaPaths,
    create_file,
    map_fd,
    open_file,
    shm_huge_pages,
)
from fineslab.slabs.table import SlabTable, TableDims, creator_of_header, read_header

logger = logging.getLogger(__name__)

BACKING_CPU = 0
BACKING_CUDA = 1  # CUDA IPC of one torch allocation (cuda_backing.py): KV only
BACKING_CUDA_VMM = 2  # CUDA virtual memory (cuda_vmm.py): KV and weight regions


@dataclass(frozen=True)
class ArenaSpec:
    """What the launcher decides for one device."""

    fleet_id: str
    device: str
    arena_bytes: int
    slab_bytes: int
    max_blocks_per_slab: int
    max_runtimes: int = 64

    def __post_init__(self) -> None:
        if self.slab_bytes <= 0 or self.arena_bytes < self.slab_bytes:
            raise ConfigError(f"arena of {self.arena_bytes} B cannot hold one slab of "
                              f"{self.slab_bytes} B")
        if self.arena_bytes % self.slab_bytes:
            raise ConfigError(f"arena_bytes {self.arena_bytes} is not a multiple of slab_bytes "
                              f"{self.slab_bytes}; use ArenaSpec.fit")

    @classmethod
    def fit(cls, fleet_id: str, device: str, budget_bytes: int, slab_bytes: int,
            formats: list[BlockFormat], max_runtimes: int = 64) -> ArenaSpec:
        """The largest arena of whole slabs within `budget_bytes`, sized for `formats`."""
        max_bps = max(f.blocks_per_slab(slab_bytes) for f in formats)
        arena_bytes = budget_bytes // slab_bytes * slab_bytes
        return cls(fleet_id, device, arena_bytes, slab_bytes, max_bps, max_runtimes)

    @property
    def num_slabs(self) -> int:
        return self.arena_bytes // self.slab_bytes

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def dims(self) -> TableDims:
        return TableDims(self.num_slabs, self.slab_bytes, self.max_blocks_per_slab,
                         self.max_runtimes)


class ArenaBacking(Protocol):
    """Where the arena's bytes live; `tensor()` is a 1-D uint8 torch tensor over all of them."""

    def tensor(self) -> object: ...

    def close(self) -> None: ...


class CpuBacking:
    """The arena bytes in a shared-memory file, mapped into this process."""

    def __init__(self, path: Path, arena_bytes: int, create: bool) -> None:
        self.path = path
        self._fd = create_file(path, arena_bytes) if create else open_file(path, True)
        self._mm = map_fd(self._fd, arena_bytes, writable=True)
        # Huge pages where /dev/shm gives them: whichever process touches a page first decides
        # its size, so every process's mapping asks (slabs/weights.py, HUGE_PAGE_BYTES).
        with contextlib.suppress(AttributeError, OSError):
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        self._tensor: object | None = None

    def tensor(self) -> object:
        if self._tensor is None:
            import torch  # torch only where the bytes are used: the table stays torch-free

            self._tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._tensor

    def close(self) -> None:
        self._tensor = None
        try:
            self._mm.close()
        except BufferError:
            logger.debug("arena %s: tensors still alive; the mapping closes with them",
                         self.path)
        os.close(self._fd)


class SlabArena:
    """A device's arena bytes and slab table, as created by the owner or attached by others."""

    def __init__(self, spec: ArenaSpec, paths: ArenaPaths, table: SlabTable,
                 backing: ArenaBacking, is_creator: bool) -> None:
        self.spec, self.paths, self.table = spec, paths, table
        self._backing, self.is_creator = backing, is_creator

    @classmethod
    def create(cls, spec: ArenaSpec, shm_dir: Path | None = None,
               reclaim_stale: bool = True) -> SlabArena:
        """Allocate the arena and its table (the launcher, once per device)."""
        paths = ArenaPaths.of(spec.fleet_id, spec.device, shm_dir)
        _clear_stale(paths, reclaim_stale)
        backing: ArenaBacking
        if spec.is_cuda:
            backing, kind, handle = _cuda_backing(spec, paths)
        else:
            backing, kind, handle = CpuBacking(paths.data, spec.arena_bytes, True), BACKING_CPU, b""
        try:
            table = SlabTable.create(paths.table, spec.dims(), kind, handle)
        except BaseException:
            backing.close()
            paths.data.unlink(missing_ok=True)
            raise
        logger.info("arena %s: %d slabs of %d B (%s)", paths.table.stem, spec.num_slabs,
                    spec.slab_bytes, "cuda" if spec.is_cuda
                    else f"cpu shm, huge pages: {shm_huge_pages(paths.data.parent)}")
        return cls(spec, paths, table, backing, is_creator=True)

    @classmethod
    def attach(cls, fleet_id: str, device: str, shm_dir: Path | None = None) -> SlabArena:
        """Open the arena a launcher created (a runtime process)."""
        paths = ArenaPaths.of(fleet_id, device, shm_dir)
        table = SlabTable.open(paths.table)
        dims = table.dims
        spec = ArenaSpec(fleet_id, device, dims.num_slabs * dims.slab_bytes, dims.slab_bytes,
                         dims.max_blocks_per_slab, dims.max_runtimes)
        backing: ArenaBacking
        if table.backing == BACKING_CUDA_VMM:
            from fineslab.slabs.cuda_vmm import VmmBacking

            backing = VmmBacking.open(table.handle_bytes())
        elif table.backing == BACKING_CUDA:
            from fineslab.slabs.cuda_backing import CudaBacking

            backing = CudaBacking.open(table.handle_bytes())
        else:
            backing = CpuBacking(paths.data, spec.arena_bytes, create=False)
        return cls(spec, paths, table, backing, is_creator=False)

    def tensor(self) -> object:
        """The arena as a 1-D uint8 torch tensor (pass it to `layer_views`)."""
        return self._backing.tensor()

    @property
    def backing(self) -> ArenaBacking:
        """What holds the bytes: a `VmmBacking` is what a `CudaWeightRegion` maps slabs of."""
        return self._backing

    def client(self, runtime_id: str, fmt: BlockFormat, pooled: bool = False
               ) -> RuntimeSlabs | PooledSlabs:
        """A block allocator for `runtime_id` on this arena's table: slabs of its own, or
        (`pooled`) its key's pool shared with the other pooled runtimes of its block stride."""
        if pooled:
            return PooledSlabs(self.table, runtime_id, fmt)
        return RuntimeSlabs(self.table, runtime_id, fmt)

    def close(self) -> None:
        """Unmap; the creator also unlinks the files (clean shutdown)."""
        self._backing.close()
        self.table.close()
        if self.is_creator:
            self.paths.unlink()

    def __enter__(self) -> SlabArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cuda_backing(spec: ArenaSpec, paths: ArenaPaths) -> tuple[ArenaBacking, int, bytes]:
    """CUDA virtual memory where the driver offers it (weights can then live in the arena);
    else CUDA IPC of one allocation, KV only, with a warning saying why."""
    from fineslab.slabs.cuda_backing import CudaBacking
    from fineslab.slabs.cuda_vmm import VmmBacking

    try:
        vmm = VmmBacking.allocate(spec.device, spec.arena_bytes, spec.slab_bytes, paths.data)
        return vmm, BACKING_CUDA_VMM, vmm.handle_bytes()
    except EnvironmentSetupError as exc:
        logger.warning("arena on %s: CUDA virtual memory unavailable (%s); falling back to "
                       "CUDA IPC (KV only: weights cannot live in this arena)", spec.device, exc)
    cuda = CudaBacking.allocate(spec.device, spec.arena_bytes)
    return cuda, BACKING_CUDA, cuda.handle_bytes()


def _clear_stale(paths: ArenaPaths, reclaim_stale: bool) -> None:
    """Refuse a live arena of the same name; reclaim (or refuse) one whose creator is gone."""
    if not paths.table.exists() and not paths.data.exists():
        return
    creator = _creator_of(paths.table)
    if creator is not None and creator.is_alive():
        raise EnvironmentSetupError(
            f"arena {paths.table} belongs to live pid {creator.pid}: another fleet uses this "
            "fleet id and device; stop it or pick another fleet id")
    if not reclaim_stale:
        raise EnvironmentSetupError(
            f"stale arena files {paths.table} / {paths.data} from a crashed run; remove them "
            "or create with reclaim_stale=True")
    logger.warning("arena %s: reclaiming files of a crashed run (creator %s)", paths.table,
                   creator)
    paths.unlink()


def remove_dead_arenas(fleet_id: str, shm_dir: Path | None = None) -> list[Path]:
    """Unlink every arena of `fleet_id` whose creator (its launcher) is gone; returns the
    tables removed. Runtimes' lifelines call it once they have stopped their tree, so the
    memory of a CPU arena does not outlive a launcher killed with SIGKILL."""
    folder = shm_dir or default_shm_dir()
    pattern = re.compile(rf"^fineslab-{re.escape(fleet_id)}-(cpu\d*|cuda\d+)\.table$")
    removed = []
    for table in sorted(folder.glob(f"fineslab-{fleet_id}-*.table")):
        if not pattern.match(table.name):
            continue
        creator = _creator_of(table)
        if creator is not None and creator.is_alive():
            continue
        ArenaPaths(table, table.with_suffix(".arena")).unlink()
        removed.append(table)
    return removed


def _creator_of(table_path: Path) -> ProcessIdentity | None:
    try:
        fd = open_file(table_path, writable=False)
    except FileNotFoundError:
        return None
    try:
        header = read_header(fd, wait_s=0.0)
    except EnvironmentSetupError:
        return None
    finally:
        os.close(fd)
    return creator_of_header(header)


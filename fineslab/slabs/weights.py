"""WeightRegion: a runtime's weights in whole slabs of its device's arena, at fixed addresses.

A model's tensors need contiguous memory, but the slabs free in an arena are scattered, and they
differ from one wake to the next. So, as kvcached does with CUDA virtual memory, the region
separates the address from the memory (CPU backing; the CUDA path is not built yet):

    reserve   one range of virtual addresses, slab-aligned, inaccessible (PROT_NONE), for the
              life of the process: the tensors built over it never move
    back      take N whole slabs of the arena (any N free ones) and map slab i of the list at
              base + i * slab_bytes (mmap MAP_FIXED | MAP_SHARED of the arena file at that slab's
              offset): the range reads and writes arena memory
    unback    map the range inaccessible again (a touch then faults loudly instead of reading
              another model's bytes) and give the slabs back to the arena

The slabs belong to an owner of their own in the slab table (`<runtime_id>:w`, block stride =
slab size, one block per slab, FULL while held): the table, the inspector and /metrics show a
model's weights apart from its KV, and a dead runtime's weight slabs are reclaimed with the
same rule as its KV slabs (its process is gone).

    back:    num_slabs == ceil(nbytes / slab_bytes) slabs taken, all or none (ArenaExhausted)
    unback:  those slabs FREE again; the range faults on access
    the range's base address is the same for the region's whole life

Cost: one mmap per slab on back (microseconds each), one on unback; the copy of the weights
into a freshly backed range runs at memcpy speed because arena pages stay resident (tmpfs
keeps them; see ../shared/SGLANG-ON-CPU.md).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from fineslab.errors import ConfigError, IntegrityError
from fineslab.slabs.table import SlabState, SlabTable

logger = logging.getLogger(__name__)

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
# Linux values (the mmap module lacks MAP_FIXED). MAP_POPULATE fills the page tables at map
# time, in bulk: without it the wake's copy takes a minor fault per 4 KiB page.
_MAP_FIXED, _MAP_NORESERVE, MAP_POPULATE = 0x10, 0x4000, 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

#: Suffix of the slab-table owner that holds a runtime's weights.
WEIGHTS_SUFFIX = ":w"


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    out = _libc.mmap(addr, length, prot, flags, fd, offset)
    if out in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} B failed: {os.strerror(err)}")
    if addr is not None and out != addr:
        raise OSError(f"mmap placed {length} B at {out:#x}, not at {addr:#x}")
    return int(out)


class WeightRegion:
    """`nbytes` of weights of `runtime_id` in whole slabs of a CPU arena (see module doc)."""

    def __init__(self, table: SlabTable, arena_path: Path, runtime_id: str, nbytes: int) -> None:
        slab_bytes = table.dims.slab_bytes
        if slab_bytes % mmap.PAGESIZE:
            raise ConfigError(f"slab size {slab_bytes} B is not a multiple of the page size "
                              f"{mmap.PAGESIZE} B: weights cannot be mapped slab by slab")
        if nbytes <= 0:
            raise ConfigError(f"a weight region needs a positive size, got {nbytes} B")
        self.table, self.runtime_id, self.nbytes = table, runtime_id, nbytes
        self.slab_bytes = slab_bytes
        self.num_slabs = -(-nbytes // slab_bytes)
        self.span_bytes = self.num_slabs * slab_bytes
        self._fd = os.open(arena_path, os.O_RDWR)
        self.slot = table.register(runtime_id + WEIGHTS_SUFFIX, slab_bytes)
        self.base = _mmap(None, self.span_bytes, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        self.slab_ids: np.ndarray | None = None
        self._closed = False

    @property
    def backed(self) -> bool:
        return self.slab_ids is not None

    def back(self) -> np.ndarray:
        """Take the slabs and map them under the range; returns their ids (in range order)."""
        if self.slab_ids is not None:
            return self.slab_ids
        slabs = carve_weight_slabs(self.table, self.slot, self.num_slabs)
        try:
            for i, slab in enumerate(slabs.tolist()):
                _mmap(self.base + i * self.slab_bytes, self.slab_bytes, _PROT_RW,
                      mmap.MAP_SHARED | _MAP_FIXED | MAP_POPULATE, self._fd,
                      slab * self.slab_bytes)
        except OSError:
            self._cover()
            self._give_back(slabs)
            raise
        self.slab_ids = slabs
        return slabs

    def unback(self) -> None:
        """Make the range inaccessible and give its slabs back to the arena."""
        if self.slab_ids is None:
            return
        self._cover()
        slabs, self.slab_ids = self.slab_ids, None
        self._give_back(slabs)

    def tensor(self) -> Any:
        """A uint8 torch tensor over the whole range (valid while backed; never moves)."""
        import torch

        buffer = (ctypes.c_uint8 * self.nbytes).from_address(self.base)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def close(self) -> None:
        """Give the slabs back and unregister. The range stays reserved (inaccessible): tensors
        built over it may outlive the region, and must fault, not read reused memory."""
        if self._closed:
            return
        self._closed = True
        self.unback()
        self.table.unregister(self.slot)
        os.close(self._fd)

    def _cover(self) -> None:
        _mmap(self.base, self.span_bytes, _PROT_NONE,
              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)

    def _give_back(self, slabs: np.ndarray) -> None:
        release_weight_slabs(self.table, self.slot, slabs, self.runtime_id)


def carve_weight_slabs(table: SlabTable, slot: int, num_slabs: int) -> np.ndarray:
    """Take `num_slabs` free slabs for weight owner `slot` (registered with key = slab_bytes),
    each one block, FULL at once; ArenaExhausted (nothing changed) when short. The simulator's
    weights take slabs through this too (`fineslab.sim.elastic`)."""
    with table.lock():
        slabs = table.carve_locked(slot, num_slabs, slot)
        table.free_map[slabs, 0] = 0
        table.used[slabs] = 1
        table.state[slabs] = SlabState.FULL
    return slabs


def release_weight_slabs(table: SlabTable, slot: int, slabs: np.ndarray, name: str) -> None:
    """Give weight slabs of `slot` back to the free space (IntegrityError if one is not its)."""
    with table.lock():
        for slab in slabs.tolist():
            if table.owner[slab] != slot:
                raise IntegrityError(f"weight slab {slab} of {name} is owned by "
                                     f"slot {table.owner[slab]}, not {slot}")
            table.release_locked(slab)

"""CUDA virtual memory for the arena: one physical allocation, mapped whole for KV, slab by slab
for weights (issue #16's CUDA weight region).

Why: a model's weights need fixed addresses for the life of its process (SGLang holds its
parameter tensors, CUDA graphs bake their addresses in), yet a wake finds the arena's free slabs
scattered and different each time. CUDA's virtual memory management separates the address from
the memory, as mmap does for the CPU arena (weights.py), and as kvcached and torch's expandable
segments do:

    physical    one cuMemCreate per slab, each exportable as a POSIX file descriptor; every
                process of the fleet imports them all (`VmmBacking.open`)
    arena view  each process reserves an address range and maps the slabs there back to back:
                the arena tensor KV views are carved from (what CudaBacking's IPC view was)
    weights     a runtime reserves a second range of `num_slabs * slab_bytes` and maps slab s's
                allocation at position i: contiguous addresses over scattered slabs; unmapping a
                position makes a touch fault (a CUDA error that ends the context: loud, never
                another model's bytes)

    slab_bytes % granularity == 0 (2 MiB on Hopper) for weights; otherwise one allocation for
    the arena (rounded up to the granularity), KV only

Sharing the descriptors: the owner keeps them open and serves them on a unix socket whose path
the table header names (fd_share.py, SCM_RIGHTS, same uid only); a runtime fetches its
duplicates once, imports each allocation and closes the descriptor (the imported handle holds
the memory). Not pidfd_getfd(2): that needs ptrace access to the launcher, which a non-root
runtime lacks under the default kernel.yama.ptrace_scope = 1.

Cost: cuMemMap + cuMemSetAccess per slab on back, microseconds each, no copy; the bytes of the
arena stay allocated (resident) for the fleet's life, so a wake's copy runs at the link's speed.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from functools import cache
from pathlib import Path
from typing import Any

from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.slabs.fd_share import FdServer, fetch_fds

logger = logging.getLogger(__name__)

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp (cuda.h, CUDA 11+), 32 bytes
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The few CUDA driver calls the arena needs, through ctypes on libcuda (no extra package)."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise EnvironmentSetupError(f"the CUDA driver (libcuda.so.1) is not loadable: {exc}"
                                        ) from exc
        self._check(self._lib.cuInit(0), "cuInit")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(name))
            text = name.value.decode() if name.value else "unknown error"
            raise EnvironmentSetupError(f"CUDA driver {what} failed: {text} ({result})")

    def make_current(self, ordinal: int) -> None:
        """Make device `ordinal`'s primary context (the one torch uses) current on this thread."""
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
                    "cuDevicePrimaryCtxRetain")
        self._check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _prop(ordinal: int) -> _AllocProp:
        prop = _AllocProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
        return prop

    def granularity(self, ordinal: int) -> int:
        out = ctypes.c_size_t()
        prop = self._prop(ordinal)
        self._check(self._lib.cuMemGetAllocationGranularity(
            ctypes.byref(out), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity")
        return int(out.value)

    def create(self, nbytes: int, ordinal: int) -> int:
        handle = ctypes.c_uint64()
        prop = self._prop(ordinal)
        self._check(self._lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(nbytes),
                                          ctypes.byref(prop), ctypes.c_uint64(0)),
                    f"cuMemCreate of {nbytes} B")
        return int(handle.value)

    def release(self, handle: int) -> None:
        self._check(self._lib.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self._check(self._lib.cuMemExportToShareableHandle(
            ctypes.byref(fd), ctypes.c_uint64(handle), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ctypes.c_uint64(0)), "cuMemExportToShareableHandle")
        return int(fd.value)

    def import_fd(self, fd: int) -> int:
        handle = ctypes.c_uint64()
        self._check(self._lib.cuMemImportFromShareableHandle(
            ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle")
        return int(handle.value)

    def reserve(self, nbytes: int, alignment: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self._lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(alignment),
            ctypes.c_uint64(0), ctypes.c_uint64(0)), f"cuMemAddressReserve of {nbytes} B")
        return int(ptr.value)

    def free_range(self, ptr: int, nbytes: int) -> None:
        self._check(self._lib.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes)),
                    "cuMemAddressFree")

    def map(self, ptr: int, nbytes: int, handle: int, ordinal: int) -> None:
        """Map `nbytes` of allocation `handle`, from its start, at `ptr`, readable and writable
        (from its start only: a non-zero offset answered 801 on an H200, VmmBacking's doc)."""
        self._check(self._lib.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes),
                                       ctypes.c_size_t(0), ctypes.c_uint64(handle),
                                       ctypes.c_uint64(0)), "cuMemMap")
        access = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, ordinal),
                             CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._check(self._lib.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes),
                                             ctypes.byref(access), ctypes.c_size_t(1)),
                    "cuMemSetAccess")

    def unmap(self, ptr: int, nbytes: int) -> None:
        self._check(self._lib.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes)),
                    "cuMemUnmap")


@cache
def driver() -> Driver:
    return Driver()


class _CudaArray:
    """Device bytes described by __cuda_array_interface__, for `torch.as_tensor` (zero copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def tensor_at(ptr: int, nbytes: int, ordinal: int) -> Any:
    """A uint8 torch tensor over `nbytes` of mapped device memory at `ptr` (never owns it)."""
    import torch

    return torch.as_tensor(_CudaArray(ptr, nbytes), device=f"cuda:{ordinal}")


def device_ordinal(device: str) -> int:
    import torch

    index = torch.device(device).index
    return 0 if index is None else int(index)


class VmmBacking:
    """The arena as exportable physical allocations mapped back to back in this process.

    One allocation per slab when the slab size is a multiple of the mapping granularity (a
    weight region maps single slabs, and the driver maps an allocation only from its start:
    cuMemMap with a non-zero offset answered 801, "operation not supported", on an H200 with
    driver 580); otherwise one allocation for the whole arena (KV only).
    Owner: `allocate` creates, maps, zeroes and exports them, and serves the descriptors at
    `socket_path` until `close()`; runtimes: `open` fetches and imports them.

        physical[s] backs [base + s * slab_bytes, base + (s + 1) * slab_bytes)   (per slab)
    """

    def __init__(self, ordinal: int, physical: list[int], base: int, chunk_bytes: int,
                 arena_bytes: int, owner_fds: list[int], handle: bytes) -> None:
        self.ordinal, self.physical, self.base = ordinal, physical, base
        self.chunk_bytes, self.arena_bytes = chunk_bytes, arena_bytes
        self.mapped_bytes = chunk_bytes * len(physical)
        self._owner_fds, self._handle = owner_fds, handle
        self._server: FdServer | None = None
        self._tensor: Any = tensor_at(base, arena_bytes, ordinal)

    def physical_of(self, slab: int, slab_bytes: int) -> int:
        """The allocation holding slab `slab` (ConfigError if slabs are not allocated apart)."""
        if self.chunk_bytes != slab_bytes:
            raise ConfigError(f"this CUDA arena was not allocated slab by slab (slab {slab_bytes}"
                              f" B is not a multiple of the mapping granularity): weights cannot "
                              "live in it")
        return self.physical[slab]

    @staticmethod
    def _map_all(ordinal: int, physical: list[int], chunk_bytes: int) -> int:
        drv = driver()
        total = chunk_bytes * len(physical)
        base = drv.reserve(total, drv.granularity(ordinal))
        done = 0
        try:
            for handle in physical:
                drv.map(base + done * chunk_bytes, chunk_bytes, handle, ordinal)
                done += 1
        except EnvironmentSetupError:
            for i in range(done):
                drv.unmap(base + i * chunk_bytes, chunk_bytes)
            drv.free_range(base, total)
            raise
        return base

    @classmethod
    def allocate(cls, device: str, arena_bytes: int, slab_bytes: int,
                 socket_path: Path) -> VmmBacking:
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentSetupError(f"arena on {device}: no CUDA device is visible")
        ordinal = device_ordinal(device)
        torch.cuda.init()
        drv = driver()
        drv.make_current(ordinal)
        grain = drv.granularity(ordinal)
        if slab_bytes % grain == 0:
            chunk, count = slab_bytes, arena_bytes // slab_bytes
        else:
            chunk, count = -(-arena_bytes // grain) * grain, 1
        _raise_fd_limit(count + 64)
        physical: list[int] = []
        fds: list[int] = []
        try:
            for _ in range(count):
                physical.append(drv.create(chunk, ordinal))
                fds.append(drv.export_fd(physical[-1]))
            base = cls._map_all(ordinal, physical, chunk)
        except EnvironmentSetupError:
            for fd in fds:
                os.close(fd)
            for allocation in physical:
                drv.release(allocation)
            raise
        handle = json.dumps({"kind": "vmm", "socket": str(socket_path), "device": ordinal,
                             "chunk_bytes": chunk, "slabs": count,
                             "arena_bytes": arena_bytes}).encode()
        backing = cls(ordinal, physical, base, chunk, arena_bytes, fds, handle)
        backing._server = FdServer(socket_path, fds)
        backing._tensor.zero_()
        torch.cuda.synchronize(ordinal)
        logger.info("arena on %s: %d B of CUDA virtual memory in %d allocation(s)", device,
                    chunk * count, count)
        return backing

    @classmethod
    def open(cls, handle: bytes) -> VmmBacking:
        import torch

        doc = json.loads(handle)
        if doc.get("kind") != "vmm":
            raise ConfigError("the arena's handle is not a CUDA virtual-memory handle")
        ordinal = int(doc["device"])
        torch.cuda.init()
        drv = driver()
        drv.make_current(ordinal)
        physical: list[int] = []
        fds = fetch_fds(Path(doc["socket"]))
        if len(fds) != int(doc["slabs"]):
            for fd in fds:
                os.close(fd)
            raise EnvironmentSetupError(f"the arena's descriptor server sent {len(fds)} "
                                        f"descriptors, not {doc['slabs']}")
        try:
            for i, fd in enumerate(fds):
                physical.append(drv.import_fd(fd))
                os.close(fd)  # the imported handle holds the memory, not the descriptor
                fds[i] = -1
            base = cls._map_all(ordinal, physical, int(doc["chunk_bytes"]))
        except EnvironmentSetupError:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            for imported in physical:
                drv.release(imported)
            raise
        return cls(ordinal, physical, base, int(doc["chunk_bytes"]), int(doc["arena_bytes"]),
                   [], handle)

    def handle_bytes(self) -> bytes:
        return self._handle

    def tensor(self) -> Any:
        if self._tensor is None:
            raise EnvironmentSetupError("arena backing used after close()")
        return self._tensor

    def close(self) -> None:
        """Unmap and drop this process's references (the memory goes with the last one)."""
        import torch

        if self._tensor is None:
            return
        torch.cuda.synchronize(self.ordinal)
        self._tensor = None
        drv = driver()
        for i, handle in enumerate(self.physical):
            drv.unmap(self.base + i * self.chunk_bytes, self.chunk_bytes)
            drv.release(handle)
        drv.free_range(self.base, self.mapped_bytes)
        if self._server is not None:
            self._server.close()
            self._server = None
        for fd in self._owner_fds:
            os.close(fd)
        self._owner_fds = []


def _raise_fd_limit(needed: int) -> None:
    """The owner keeps one descriptor per slab open: lift the soft limit toward the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed + 1024:
        target = needed + 1024 if hard == resource.RLIM_INFINITY else min(hard, needed + 1024)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

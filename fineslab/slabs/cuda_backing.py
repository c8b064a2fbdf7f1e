"""CUDA backing of the arena: one device allocation by the owner, opened by runtimes via CUDA IPC.

The owner (launcher) calls `CudaBacking.allocate(device, arena_bytes)` once: a `torch.empty` of
uint8 on the device, zeroed, whose storage it exports with `UntypedStorage._share_cuda_()` (the
call torch.multiprocessing uses to send CUDA tensors). The export is an 8-field record (device,
cudaIpcMemHandle bytes, storage size and offset, torch's IPC ref-counter file handle and offset,
event handle, event-sync flag); we store it as JSON (bytes as base64, never pickle: the table file
is data, not code) in the table header. A runtime calls `CudaBacking.open(handle)` once:
`UntypedStorage._new_shared_cuda(*record)` maps the same memory (cudaIpcOpenMemHandle) and a
uint8 tensor is set over it. After that no allocation, mapping or driver call happens: blocks
are handed out by the slab table alone.

Lifetime: the owner must keep the arena alive (it does until `SlabArena.close()`) while any
runtime has it open; torch's IPC ref counter also keeps the producer's block from being reused
while consumers hold it. CUDA IPC needs the processes on one node, and the storage must be a
plain device allocation (not an expandable segment: leave PYTORCH_CUDA_ALLOC_CONF's
`expandable_segments` off in the launcher).
"""

from __future__ import annotations

import base64
import json
import logging

import torch

from fineslab.errors import EnvironmentSetupError

logger = logging.getLogger(__name__)

_BYTES_FIELDS = (1, 4, 6)  # handle, ref-counter handle, event handle


def _encode(record: tuple[object, ...], numel: int, offset: int) -> bytes:
    fields = [base64.b64encode(v).decode() if isinstance(v, bytes) and i in _BYTES_FIELDS
              else v for i, v in enumerate(record)]
    return json.dumps({"share": fields, "numel": numel, "offset": offset}).encode()


def _decode(raw: bytes) -> tuple[list[object], int, int]:
    doc = json.loads(raw)
    fields = [base64.b64decode(v) if i in _BYTES_FIELDS and v is not None else v
              for i, v in enumerate(doc["share"])]
    return fields, int(doc["numel"]), int(doc["offset"])


class CudaBacking:
    """The arena as a CUDA tensor; owner side holds the allocation, runtime side the IPC view."""

    def __init__(self, tensor: torch.Tensor, handle: bytes) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._handle = handle

    @classmethod
    def allocate(cls, device: str, arena_bytes: int) -> CudaBacking:
        if not torch.cuda.is_available():
            raise EnvironmentSetupError(f"arena on {device}: no CUDA device is visible")
        tensor = torch.zeros(arena_bytes, dtype=torch.uint8, device=device)
        record = tensor.untyped_storage()._share_cuda_()
        logger.info("arena on %s: %d B exported for CUDA IPC", device, arena_bytes)
        return cls(tensor, _encode(tuple(record), tensor.numel(), int(tensor.storage_offset())))

    @classmethod
    def open(cls, handle: bytes) -> CudaBacking:
        if not torch.cuda.is_available():
            raise EnvironmentSetupError("the arena is on CUDA but this process sees no GPU")
        fields, numel, offset = _decode(handle)
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        tensor = torch.empty(0, dtype=torch.uint8, device=storage.device)
        tensor.set_(storage, offset, (numel,), (1,))
        return cls(tensor, handle)

    def handle_bytes(self) -> bytes:
        return self._handle

    def tensor(self) -> object:
        if self._tensor is None:
            raise EnvironmentSetupError("arena backing used after close()")
        return self._tensor

    def close(self) -> None:
        if self._tensor is not None:
            torch.cuda.synchronize(self._tensor.device)
        self._tensor = None

"""Per-thread scratch buffers for the CPU kernels that convert or unpack a weight per call.

A fresh [K, N] temporary a call costs more in page faults than the conversion itself (AWQ's
unpacked int32 values: about 4x; the fp32 copy of a bf16 weight likewise), so each thread keeps
one buffer per dtype and grows it to the largest request seen. What `scratch` returns is this
thread's until its next call for the same dtype: a caller finishes with it before asking again.
"""

from __future__ import annotations

import threading

import torch


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}


_buffers = _Buffers()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` values of `dtype`, uninitialised, shared with this thread's
    next call for `dtype` (grow-only: the largest size asked is kept)."""
    buffer = _buffers.by_dtype.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _buffers.by_dtype[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]

"""Plain-torch AWQ dequantization: the one AWQ op SGLang 0.5.23 calls when it serves AWQ on CPU.

Where SGLang calls it: without Intel AMX kernels (`torch.ops.sgl_kernel.convert_weight_packed`,
absent from this stand-in) `awq` resolves to `AWQConfig` -> `AWQLinearKernel.apply`, which calls
`torch.ops.sglang.awq_dequantize(qweight, scales, qzeros)` (a custom op SGLang registers for CUDA
only) and then `torch.matmul(x, weight)`. This module gives that op a CPU kernel, and also serves
as `sgl_kernel.awq_dequantize` (the name SGLang's XPU path imports).

AWQ format (GEMM version), for a linear layer with K inputs, N outputs, group size G:
    qweight [K, N / 8] int32, qzeros [K / G, N / 8] int32, scales [K / G, N] fp16/bf16
    int32 word j of a row packs columns 8j..8j+7; nibble i (bits 4i..4i+3) holds column
    8j + ORDER[i], ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    weight[k, n] = (q[k, n] - zero[k // G, n]) * scale[k // G, n]      -> [K, N], x @ weight

Cost: one [K, N] temporary in the scales' dtype per call (the GPU kernel does the same). The
math is `fineslab.quant.awq.dequantize_packed` (fineslab is importable wherever the CPU mode
runs SGLang: its plugin is).
"""

from __future__ import annotations

import torch

from fineslab.quant.awq import dequantize_packed


def awq_dequantize(qweight: torch.Tensor, scales: torch.Tensor,
                   qzeros: torch.Tensor) -> torch.Tensor:
    """The [K, N] weight in `scales.dtype` from AWQ's packed qweight, scales and qzeros
    (`fineslab.quant.awq.dequantize_packed`, which the gpu-lite stand-in's CUDA fallback runs
    too)."""
    return dequantize_packed(qweight, scales, qzeros)


_LIBRARY: torch.library.Library | None = None


def register_cpu_kernels() -> None:
    """Give SGLang's `sglang::awq_dequantize` a CPU kernel (idempotent).

    Registering an implementation before SGLang defines the op is allowed by torch's dispatcher,
    so the import order of this stand-in and SGLang's `awq_kernels` does not matter.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _LIBRARY = torch.library.Library("sglang", "IMPL")
    _LIBRARY.impl("awq_dequantize", awq_dequantize, "CPU")

"""Torch fallbacks for the two kernels SGLang 0.5.23 compiles at first use on FP8 and AWQ paths.

On CUDA, with fineslab's `sgl_kernel` stand-in and the triton attention backend, a W8A8 FP8
linear and an AWQ linear each call one kernel that SGLang builds with nvcc through tvm-ffi at
first use (`sglang.kernels.jit`) and has no plain alternative for on CUDA:

    op (torch.ops.sglang.*)  SGLang's caller (0.5.23)                fallback (fineslab.quant)
    per_token_quant_fp8      fp8_utils.apply_fp8_linear (dynamic)       fp8.quantize_fp8_per_token
                             -> fp8_kernel.sglang_per_token_quant_fp8
                             -> kernels/ops/quantization sgl_per_token_quant_fp8
                             (JIT: kernels/ops/quantization/per_token_quant_fp8.py)
    awq_dequantize           awq_kernels.AWQLinearKernel.apply, matmul  awq.dequantize_packed
                             (JIT: kernels/ops/quantization/awq_dequantize.py)

The seam is SGLang's own: both register their op with `direct_register_custom_op`, which skips
a name already defined in the `sglang` namespace, and then call `torch.ops.sglang.<name>`
("a name registered elsewhere first runs that registration's function",
`sglang/srt/utils/custom_op.py`). So `register()`, run when the stand-in is imported, defines
both ops first with these torch kernels (CUDA and CPU); no nvcc, no compile time in a short
loan. First, because SGLang imports the stand-in before either registration:
`srt/layers/quantization/utils.py` imports `sgl_kernel.scalar_type` at import, awq_kernels
imports that module before registering, and the per-token op registers at its first call.
If SGLang defined one first (the stand-in imported late), our kernels override its CUDA kernel
through the dispatcher, and `register` says so in its result.

The rest of those paths needs nothing compiled: the FP8 GEMM is SGLang's `Fp8ScaledMMOp`, whose
`forward_native` (`torch._scaled_mm`, row-wise scales) `SGLANG_FORCE_FUSED_OP_BACKEND=torch`
selects, or its Triton `triton_scaled_mm` for shapes not multiple of 16; the weight's
per-tensor -> per-channel scale conversion at load is plain torch.

Cost: the FP8 quant is 3-4 elementwise kernels and a row max per call instead of one fused
kernel; AWQ dequantization one [K, N] int32 temporary per call (as SGLang's kernel, one more).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fineslab.quant.awq import dequantize_packed
from fineslab.quant.fp8 import quantize_fp8_per_token

logger = logging.getLogger(__name__)

DEVICE_KEYS = ("CUDA", "CPU")


def per_token_quant_fp8(input: torch.Tensor, output_q: torch.Tensor,
                        output_s: torch.Tensor) -> None:
    """SGLang's `per_token_quant_fp8(input, output_q, output_s)`: each row of `input` to e4m3
    in `output_q`, its float32 scale (amax / 448) in `output_s` ([T] or [T, 1])."""
    q, scale = quantize_fp8_per_token(input)
    output_q.copy_(q)
    output_s.copy_(scale.view(output_s.shape))


def awq_dequantize(qweight: torch.Tensor, scales: torch.Tensor,
                   qzeros: torch.Tensor) -> torch.Tensor:
    """SGLang's `awq_dequantize(qweight, scales, qzeros)`: the [K, N] weight in scales' dtype."""
    return dequantize_packed(qweight, scales, qzeros)


def _awq_fake(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] * 8), dtype=scales.dtype)


@dataclass(frozen=True)
class Fallback:
    """One op: its schema in the namespace, the torch kernel, the fake kernel for tracing."""

    schema: str
    kernel: Callable[..., object]
    fake: Callable[..., object]

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


FALLBACKS = (
    Fallback("per_token_quant_fp8(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s) -> ()",
             per_token_quant_fp8, lambda input, output_q, output_s: None),
    Fallback("awq_dequantize(Tensor qweight, Tensor scales, Tensor qzeros) -> Tensor",
             awq_dequantize, _awq_fake),
)

#: Libraries keep their registrations alive: one per namespace, for the process's lifetime.
_LIBRARIES: dict[str, torch.library.Library] = {}
_REGISTERED: dict[str, dict[str, str]] = {}


def register(namespace: str = "sglang") -> dict[str, str]:
    """Give every op of `FALLBACKS` its torch kernel in `namespace` (idempotent).

    Returns, per op name, "defined" (ours first: SGLang will call it) or "overrode" (SGLang
    defined it first; our kernels replaced its CUDA and CPU ones). Tests pass a namespace of
    their own, so that SGLang's in the test process is left alone.
    """
    if namespace in _REGISTERED:
        return dict(_REGISTERED[namespace])
    library = torch.library.Library(namespace, "FRAGMENT")
    outcome: dict[str, str] = {}
    for fallback in FALLBACKS:
        ops = getattr(torch.ops, namespace)
        if hasattr(ops, fallback.name):
            for key in DEVICE_KEYS:
                library.impl(fallback.name, fallback.kernel, key, allow_override=True)
            outcome[fallback.name] = "overrode"
            logger.warning("torch.ops.%s.%s was defined before fineslab's gpu-lite fallback; "
                           "its CUDA and CPU kernels are replaced", namespace, fallback.name)
            continue
        library.define(fallback.schema)
        for key in DEVICE_KEYS:
            library.impl(fallback.name, fallback.kernel, key)
        library._register_fake(fallback.name, fallback.fake)
        outcome[fallback.name] = "defined"
    _LIBRARIES[namespace] = library
    _REGISTERED[namespace] = outcome
    return dict(outcome)

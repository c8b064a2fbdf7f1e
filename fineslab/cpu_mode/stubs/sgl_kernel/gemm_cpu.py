"""bf16 and fp16 matrix products in fp32 on CPUs without instructions for them (CPU mode only).

On a CPU that oneDNN cannot run bf16 or fp16 on (no AVX-512: this project's 2-core machines and
CI are AVX2), torch's half-precision `mm`/`addmm` is a scalar loop: a [64, 576] x [576, 1536]
bf16 product takes 11.7 ms where the same product in fp32, with both operands converted, takes
1.9 ms; SmolLM2-135M's forward pass of 32 tokens 923 ms against 188 ms in fp32 (one thread,
2026-11-30). fp16 is as slow, and slower still with a row-major weight (AWQ's dequantized
[K, N] weight, which SGLang multiplies as `x @ w` in fp16: 12.6 ms for 8 rows of 576 x 1536,
against 1.7 ms for `F.linear`'s transposed layout). SGLang's CPU path (no Intel AMX) runs its
linear layers, its logits and AWQ's dequantized weights through these two ops, so the CPU mode
gives them a CPU kernel that converts the operands to fp32, multiplies with torch's own fp32
kernel (`mm.out`, which this does not replace) and rounds the result to the operands' dtype
once. That is what a GPU's half-precision GEMM computes (fp32 accumulation, one rounding at the
end); against torch's bf16 loop, whose sums run in another order, 0.02% of a product's values
differ, by one step. The weights stay in their dtype: the conversion is a temporary per call.

The weight is converted into a scratch buffer this thread keeps (`fineslab.cpu_mode.scratch`; a
fresh fp32 tensor per call costs more in page faults than the product: 0.88 ms against 0.12 ms
for 576 x 1536 values).
From four rows on this is faster than torch's loop; a product of one row, padded to four (below),
costs about twice torch's (SmolLM2's one-token pass 89-106 ms against 45-50 ms). Weights of more than `MAX_CONVERTED` values (SmolLM2's 49152 x 576 logit
weights, whose product of one row takes 6 ms in bf16 and 18 ms converted) keep torch's kernel.
Which kernel a product takes depends on its weight only, never on its number of rows, and the
rows are padded to a multiple of `ROW_MULTIPLE`, so a request computes alike alone and in a
batch, as with torch's bf16 loop. Every other dtype goes to torch's own kernel.
Nothing is registered where oneDNN runs both dtypes itself (`slow_dtypes`); at run time
FINESLAB_CPU_HALF_GEMM picks the dtypes converted (`SWITCH_DTYPES`).

Every SGLang process of the CPU mode registers it (`sgl_kernel`'s stand-in is imported by
SGLang's own modules), stock SGLang's included, so fineslab's runtimes and their stock
references compute alike.
"""

from __future__ import annotations

import os
import warnings

import torch

from fineslab.cpu_mode.scratch import scratch

#: Which half-precision products are computed in fp32: `fp32` (bf16 and fp16, the default),
#: `bf16` (bf16 only) or `torch` (neither: torch's own kernels).
SWITCH_VAR = "FINESLAB_CPU_HALF_GEMM"
SWITCH_DTYPES = {"fp32": (torch.bfloat16, torch.float16), "bf16": (torch.bfloat16,), "torch": ()}
DEFAULT_SWITCH = "fp32"

_LIBRARY: torch.library.Library | None = None


#: The largest weight converted (values): 16 MiB of scratch per thread at most.
MAX_CONVERTED = 1 << 22
#: MKL's fp32 product computes a row alike in every product whose row count is a multiple of 4
#: (on one thread and on two; measured on AVX2 over eight weight shapes and 1-256 rows), but
#: not in one of 1-3 rows, nor across threads in one of 5-7: products are padded to it.
ROW_MULTIPLE = 4


def _converts(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype is b.dtype and a.dim() == 2 and b.dim() == 2 and b.numel() <= MAX_CONVERTED
            and a.dtype in _switched_on())


def _fp32(b: torch.Tensor) -> torch.Tensor:
    """`b` in fp32, in this thread's scratch buffer where its layout allows (row-major, or the
    transpose of a row-major weight: `F.linear`'s)."""
    transposed = b.t()
    if b.is_contiguous():
        source, flip = b, False
    elif transposed.is_contiguous():
        source, flip = transposed, True
    else:
        return b.float()
    converted = scratch(source.numel(), torch.float32).view(source.shape).copy_(source)
    return converted.t() if flip else converted


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` in fp32, its rows padded to a multiple of `ROW_MULTIPLE` (the padding's rows
    are not returned)."""
    rows = a.shape[0]
    padded = max(ROW_MULTIPLE, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)
    a32 = torch.empty((padded, a.shape[1]), dtype=torch.float32)
    a32[:rows].copy_(a)
    a32[rows:].zero_()
    out = torch.empty((padded, b.shape[1]), dtype=torch.float32)
    return torch.ops.aten.mm.out(a32, _fp32(b), out=out)[:rows]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _converts(a, b):
        return _product(a, b).to(a.dtype)
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b))
    return torch.ops.aten.mm.out(a, b, out=out)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    if _converts(a, b) and bias.dtype is a.dtype:
        out = _product(a, b)
        if alpha != 1:
            out.mul_(alpha)
        if beta != 0:  # addmm ignores the bias then, NaNs included
            out.add_(bias.float(), alpha=beta)
        return out.to(a.dtype)
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def slow_dtypes() -> tuple[torch.dtype, ...]:
    """The half-precision dtypes oneDNN cannot multiply on this CPU (torch's loop does)."""
    return tuple(dtype for dtype, native in (
        (torch.bfloat16, torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        (torch.float16, torch.ops.mkldnn._is_mkldnn_fp16_supported())) if not native)


def wanted() -> bool:
    """Whether this process should register the kernels (see the module's docstring)."""
    return bool(slow_dtypes())


#: (pid, the dtypes converted): the switch as the process that reads it found it. A runtime
#: forked from a zygote that registered the kernels reads it again for itself.
_switch: tuple[int, frozenset[torch.dtype]] = (0, frozenset())


def _switched_on() -> frozenset[torch.dtype]:
    global _switch
    pid = os.getpid()
    if _switch[0] != pid:
        value = os.environ.get(SWITCH_VAR, DEFAULT_SWITCH)
        if value not in SWITCH_DTYPES:
            warnings.warn(f"{SWITCH_VAR}={value!r} is not one of {', '.join(SWITCH_DTYPES)}: "
                          f"taking {DEFAULT_SWITCH!r}", stacklevel=1)
            value = DEFAULT_SWITCH
        _switch = (pid, frozenset(SWITCH_DTYPES[value]) & frozenset(slow_dtypes()))
    return _switch[1]


def register_half_gemm() -> bool:
    """Register `_mm` and `_addmm` as the CPU kernels of `aten::mm` and `aten::addmm` where
    `wanted` (idempotent); whether they are registered."""
    global _LIBRARY
    if _LIBRARY is None and wanted():
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
            warnings.simplefilter("ignore")
            library.impl("mm", _mm, "CPU")
            library.impl("addmm", _addmm, "CPU")
        _LIBRARY = library
    return _LIBRARY is not None

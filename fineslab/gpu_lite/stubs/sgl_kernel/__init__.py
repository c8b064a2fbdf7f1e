"""fineslab's stand-in for `sgl_kernel` on the air-gapped GPU machine (`fineslab.gpu_lite`).

The real wheel (sglang-kernel, 356 MiB) cannot travel there, and its `common_ops` library needs
libtorch symbols the machine's torch 2.11 lacks. SGLang 0.5.23's triton attention path imports
`sgl_kernel` at module level in many files but calls one thing of it:
`sgl_kernel.utils.is_arch_support_pdl()` (False here: programmatic dependent launch stays off).
Every other name resolves to a stub that raises `NotImplementedError` naming itself when called,
so a path that needs a compiled kernel fails loudly, at the call. `sgl_kernel.scalar_type`
raises ImportError (SGLang then uses its own fallback).

Importing it also gives SGLang's two compiled-at-first-use kernels of the FP8 W8A8 and AWQ
linears (`torch.ops.sglang.per_token_quant_fp8`, `torch.ops.sglang.awq_dequantize`) torch
kernels, before SGLang registers its own (`fineslab.gpu_lite.fallbacks`; fineslab is on the path
of the device check's processes).

Our own code; on the path of the device check's processes only (scripts/gpu_check.sh).
"""

import _fineslab_stubpkg

from fineslab.gpu_lite.fallbacks import register as _register_fallbacks

__version__ = "0.0.0+fineslab.gpu-lite"

_fineslab_stubpkg.install(__import__(__name__),
                          "fineslab's gpu-lite carry: the compiled sgl_kernel does not travel to "
                          "the air-gapped GPU machine; give this op a torch or Triton fallback")
_register_fallbacks()

"""fineslab CPU-mode stand-in for `sgl_kernel` (the CUDA-only wheel `sglang-kernel`).

SGLang imports `sgl_kernel` at module level in files that its CPU path loads, but never calls
its ops there. The real wheel fails to import without `libcuda.so.1`. This stand-in imports, and
every op raises `NotImplementedError` if called. It is only on the path in CPU mode.

Exception, real plain-torch ops (explicit attributes win over the stub `__getattr__`):
    awq_dequantize   AWQ's dequantization (`awq_cpu.py`); importing this package also registers
                     it as the CPU kernel of `torch.ops.sglang.awq_dequantize`, the op SGLang's
                     AWQ linear layers call on a machine without Intel AMX kernels.
    half products    importing this package also gives `aten::mm` and `aten::addmm` a CPU kernel
                     that computes bf16 and fp16 products in fp32 where the CPU has no
                     instructions for them (`gemm_cpu.py`: 2.6x faster a 32-token SmolLM2 pass
                     on AVX2).
"""

import _fineslab_stubpkg

from sgl_kernel.awq_cpu import awq_dequantize, register_cpu_kernels
from sgl_kernel.gemm_cpu import register_half_gemm

__version__ = "0.0.0+fineslab.cpu"

_fineslab_stubpkg.install(__import__(__name__), "fineslab's CPU mode: sgl_kernel is CUDA-only; "
                                                   "this code path needs a GPU build of SGLang")
register_cpu_kernels()
register_half_gemm()

__all__ = ["awq_dequantize"]

"""`sgl_kernel.utils` in the gpu-lite stand-in: what SGLang's triton path calls, answered."""

import _fineslab_stubpkg


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch: off (it needs the compiled kernels' launch path)."""
    return False


_fineslab_stubpkg.install(__import__(__name__, fromlist=["_"]),
                          "fineslab's gpu-lite carry: sgl_kernel.utils beyond "
                          "is_arch_support_pdl is not provided")

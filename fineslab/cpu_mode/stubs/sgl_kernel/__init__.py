"""fineslab CPU-mode stand-in for `sgl_kernel` (the CUDA-only wheel `sglang-kernel`).

SGLang imports `sgl_kernel` at module level in files that its CPU path loads, but never calls
its ops there. The real wheel fails to import without `libcuda.so.1`. This stand-in imports, and
every op raises `NotImplementedError` if called. It is only on the path in CPU mode.
"""

import _fineslab_stubpkg

__version__ = "0.0.0+fineslab.cpu"

_fineslab_stubpkg.install(__import__(__name__), "sgl_kernel is CUDA-only")

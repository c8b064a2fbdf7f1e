"""fineslab CPU-mode stand-in for `torchvision`.

The registry's torchvision wheels need CUDA torch (`operator torchvision::nms does not exist`
with the CPU build). SGLang imports torchvision in its multimodal processors, which the text
path never runs. Every attribute is a stub that raises `NotImplementedError` if called. (`transformers` sees the
package and reports torchvision as available; only its image processors would call into it.)
"""

import _fineslab_stubpkg

__version__ = "0.0.0+fineslab.cpu"

_fineslab_stubpkg.install(__import__(__name__), "fineslab's CPU mode: torchvision has no CPU build "
                                                   "that matches CPU torch; this code path needs a "
                                                   "GPU build of SGLang")

"""fineslab: co-serve many LLMs of mixed precision on shared GPUs, on unmodified SGLang.

The package is split by the boxes of the architecture (see docs/structure.md): mechanism
(`fineslab.slabs`, `fineslab.sglang_plugin`), policy (`fineslab.scheduler`, shipped from the
top-level `scheduler/` folder), serving (`fineslab.launch`, `fineslab.router`) and tools
(`fineslab.models`, `fineslab.bench`, ...). Only `fineslab.sglang_plugin` and the tools that drive
a runtime import `sglang`; the rest runs without it and without a GPU.
"""

from __future__ import annotations

__version__ = "0.1.0"

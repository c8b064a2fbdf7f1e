"""fineslab: co-serve many LLMs of mixed precision on shared GPUs, on unmodified SGLang.

The package is split by the boxes of the architecture (see docs/structure.md): mechanism
(`fineslab.slabs`, `fineslab.sglang_plugin`), policy (`fineslab.scheduler`, shipped from the
top-level `scheduler/` folder), serving (`fineslab.launch`, `fineslab.router`) and tools
(`fineslab.models`, `fineslab.bench`, ...). Only `fineslab.sglang_plugin` and the tools that drive
a runtime import `sglang`; the rest runs without it and without a GPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

#: `scheduler/` beside this package in a checkout (setup.py ships it as `fineslab.scheduler`).
_CHECKOUT_SCHEDULER = Path(__file__).resolve().parent.parent / "scheduler"


class _CheckoutScheduler(importlib.abc.MetaPathFinder):
    """`fineslab.scheduler` from a plain checkout on `sys.path`, where nothing installed maps it
    (the air-gapped GPU machine imports fineslab that way, `scripts/gpu_check.sh`: before, every
    runtime there died loading the plugin, `No module named 'fineslab.scheduler'`). Last on
    `sys.meta_path`: an installed fineslab's own mapping is found first."""

    def find_spec(self, name: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "fineslab.scheduler" or not (_CHECKOUT_SCHEDULER / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            name, _CHECKOUT_SCHEDULER / "__init__.py",
            submodule_search_locations=[str(_CHECKOUT_SCHEDULER)])


if not any(isinstance(f, _CheckoutScheduler) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutScheduler())

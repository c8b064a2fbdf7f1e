"""Shared machinery of the CPU-mode stand-in packages (see fineslab/cpu_mode/__init__.py).

Not part of fineslab's API: this file is on `sys.path` of SGLang processes in CPU mode, next to
the stand-in packages, and nothing else imports it; the GPU carry (`fineslab.gpu_lite`) ships a
copy beside its own `sgl_kernel` stand-in.

A stand-in package resolves any attribute and any sub-module import to a `Stub`: importing works,
calling raises `NotImplementedError` naming the operation, so a CPU path that reaches a CUDA-only
kernel fails loudly at the call instead of silently computing garbage.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Stub:
    """A placeholder for a missing callable, class or constant of a CUDA-only package."""

    def __init__(self, qualname: str, why: str) -> None:
        self._qualname = qualname
        self._why = why

    def __getattr__(self, name: str) -> "Stub":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub(f"{self._qualname}.{name}", self._why)

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            f"{self._qualname} was called, but only fineslab's stand-in for it is installed "
            f"({self._why})."
        )

    def __repr__(self) -> str:
        return f"<fineslab CPU stand-in {self._qualname}>"


class StubModule(types.ModuleType):
    """A module whose missing attributes are `Stub`s."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(name)
        self.__dict__["_why"] = why

    def __getattr__(self, name: str) -> Stub:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub(f"{self.__name__}.{name}", self.__dict__["_why"])


class _StubLoader(importlib.abc.Loader):
    def __init__(self, why: str) -> None:
        self._why = why

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StubModule(spec.name, self._why)
        module.__path__ = []  # a package, so that deeper sub-modules import too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    """Answers imports of `<package>.<anything>` that no real file provides."""

    def __init__(self, package: str, why: str) -> None:
        self._prefix = package + "."
        self._loader = _StubLoader(why)

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if not fullname.startswith(self._prefix):
            return None
        return importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)


def install(package: types.ModuleType, why: str) -> None:
    """Make `package` a stand-in: stub attributes and stub sub-modules (real files win)."""
    package.__class__ = StubModule
    package.__dict__["_why"] = why
    # Appended, so that real sub-module files of the stand-in (if any) are found first.
    sys.meta_path.append(_StubFinder(package.__name__, why))

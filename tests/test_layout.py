"""The package layout promised in docs/structure.md and the README."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_scheduler_is_importable_as_fineslab_scheduler() -> None:
    module = importlib.import_module("fineslab.scheduler")
    assert Path(module.__file__ or "").parent == REPO / "scheduler", (
        "fineslab.scheduler must be the top-level scheduler/ folder"
    )


def test_scheduler_is_not_a_bare_top_level_package(tmp_path: Path) -> None:
    # Run from a folder outside the repository so the checkout itself is not on sys.path.
    probe = ("import importlib.util, sys; "
             "sys.exit(importlib.util.find_spec('scheduler') is not None)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, "installing fineslab must not install a top-level 'scheduler'"


def test_structure_doc_names_every_package() -> None:
    doc = (REPO / "docs" / "structure.md").read_text()
    packages = [p.parent for p in (REPO / "fineslab").rglob("__init__.py")
                if "stubs" not in p.parts]
    missing = []
    for pkg in packages:
        dotted = ".".join(pkg.relative_to(REPO).parts)
        if f"`{dotted}`" not in doc:
            missing.append(dotted)
    assert not missing, f"docs/structure.md does not describe: {missing}"
    assert "`fineslab.scheduler`" in doc


def test_top_level_layout_exists() -> None:
    for name in ("pyproject.toml", "fineslab", "csrc", "scheduler", "profiles", "tests",
                 "examples", "docs", "scripts"):
        assert (REPO / name).exists(), f"the layout promises {name}/"

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


#: Python run with the checkout on sys.path and the editable install's finder gone: how the
#: air-gapped GPU machine imports fineslab (scripts/gpu_check.sh; nothing is installed there).
_PLAIN_CHECKOUT = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if not f.__module__.startswith('__editable__')]; "
    "sys.path.insert(0, {repo!r}); import fineslab; {before}"
    "import fineslab.scheduler.local as m; print(m.__file__)")


def test_a_plain_checkout_on_sys_path_imports_fineslab_scheduler(tmp_path: Path) -> None:
    """Found on the CPU twin of the GPU image (scripts/gpu_twin.sh): from a checkout,
    `fineslab.scheduler` (shipped from scheduler/ by setup.py) did not import, and every
    runtime there died loading the plugin. The control drops fineslab's checkout finder."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ok = subprocess.run([sys.executable, "-c", _PLAIN_CHECKOUT.format(repo=str(REPO), before="")],
                        cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip()) == REPO / "scheduler" / "local" / "__init__.py", ok.stdout
    drop = ("sys.meta_path[:] = [f for f in sys.meta_path "
            "if type(f).__name__ != '_CheckoutScheduler']; ")
    control = subprocess.run(
        [sys.executable, "-c", _PLAIN_CHECKOUT.format(repo=str(REPO), before=drop)],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert control.returncode != 0 and "No module named 'fineslab.scheduler'" in control.stderr, \
        control.stdout + control.stderr


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


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(root / "scripts" / "lint_imports.sh")], cwd=root,
                          capture_output=True, text=True, timeout=300, check=False)


def _copy_for_lint(tmp_path: Path) -> Path:
    """The files the import check reads, copied, with this checkout's .venv linked in."""
    import shutil

    root = tmp_path / "repo"
    for name in ("fineslab", "scheduler"):
        shutil.copytree(REPO / name, root / name,
                        ignore=shutil.ignore_patterns("__pycache__", "data", "stubs"))
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "lint_imports.sh", root / "scripts")
    shutil.copy(REPO / "pyproject.toml", root)
    (root / ".venv").symlink_to(REPO / ".venv")
    return root


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def test_the_import_contracts_catch_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    # Negative controls: the mechanism importing a tool breaks the layers; two modules of one
    # package importing each other (even for types only) breaks the no-cycle contract.
    root = _copy_for_lint(tmp_path)
    errors = root / "fineslab" / "slabs" / "errors_probe.py"
    errors.write_text("from fineslab.bench import report  # noqa: F401\n")
    result = _lint_imports(root)
    assert result.returncode != 0
    assert "fineslab.slabs.errors_probe -> fineslab.bench.report" in result.stdout, result.stdout
    errors.unlink()
    limits = root / "fineslab" / "slabs" / "limits.py"
    limits.write_text(limits.read_text() + "\nfrom fineslab.slabs import table  # noqa: E402\n")
    result = _lint_imports(root)
    assert result.returncode != 0
    assert "No cycles are allowed in fineslab.slabs" in result.stdout, result.stdout


def test_no_main_module_holds_library_code() -> None:
    # A `__main__` module is a command line: a parser and a call. Library code there cannot be
    # imported without running the command (cluster/node_fleet.py once imported run_fleet from one).
    import ast

    heavy = {}
    for path in (REPO / "fineslab").rglob("__main__.py"):
        tree = ast.parse(path.read_text())
        defs = [n.name for n in tree.body if isinstance(n, (ast.ClassDef,))]
        if defs:
            heavy[str(path.relative_to(REPO))] = defs
        imported_from = [n for n in ast.walk(tree)
                         if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("__main__")]
        assert not imported_from, f"{path}: imports from a __main__ module"
    assert heavy == {}, f"classes in __main__ modules: {heavy}"


def test_every_fineslab_import_in_the_notebooks_resolves() -> None:
    # A moved module broke the cpu-mixed notebook's first cell (`fineslab.bench.report` lost
    # `format_table` to `fineslab.tables`); its test found it 40 minutes into a run. This finds
    # it in a second.
    import ast
    import json

    missing = []
    for notebook in sorted((REPO / "examples").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "\n".join(line for line in "".join(cell["source"]).splitlines()
                               if not line.lstrip().startswith(("!", "%")))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "fineslab"):
                    module = importlib.import_module(node.module or "")
                    missing += [f"{notebook.name}: {node.module}.{alias.name}"
                                for alias in node.names if not hasattr(module, alias.name)
                                and importlib.util.find_spec(f"{node.module}.{alias.name}")
                                is None]
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("fineslab"):
                            importlib.import_module(alias.name)
    assert missing == [], missing

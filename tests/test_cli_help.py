"""`--help` of every command: the `fineslab` CLI's subcommands and benchmarks, and every
`python -m fineslab...` entry point (any module with a `__main__` guard, found in the source, so
that a new command without a working help fails here). Each exits 0 and prints a usage line
under the name it is run by (#39 finding 1: `python -m fineslab.sim --help` crashed; the
CPU-mode wrapper's help ran SGLang's server with `--help` as its module)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from fineslab.cli import SUBCOMMANDS, benchmarks
from fineslab.cli import main as fineslab_main

PACKAGE = Path(__file__).resolve().parents[1] / "fineslab"


def _entry_points() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if 'if __name__ == "__main__"' in path.read_text():
            found.append(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    return found


def _invoked_as(module: str) -> str:
    return "python -m " + module.removesuffix(".__main__")


def _help(entry: object, argv: list[str]) -> int:
    try:
        code = entry(argv)  # type: ignore[operator]
    except SystemExit as exc:
        code = exc.code
    return int(code or 0)


def test_the_entry_points_are_found() -> None:
    found = _entry_points()
    assert {"fineslab.launch.__main__", "fineslab.sim.__main__", "fineslab.bench.chaos",
            "fineslab.ctl", "fineslab.lifeline", "fineslab.cpu_mode.forked"} <= set(found)


@pytest.mark.parametrize("module", _entry_points())
def test_every_entry_points_help_prints_its_usage_and_exits_0(
        module: str, capfd: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(module).main
    assert inspect.signature(main).parameters, f"{module}.main takes no argv"
    assert _help(main, ["--help"]) == 0
    out = capfd.readouterr().out
    assert "usage:" in out.lower(), out[-2000:]
    if module not in ("fineslab.__main__", "fineslab.cli", "fineslab.bench.bench_serving"):
        # bench_serving prints SGLang's own parser's help, under its own name
        names = (_invoked_as(module), "fineslab ")
        assert any(name in out for name in names), f"usage not under {names}: {out[:300]}"
    assert "Traceback" not in out


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_fineslab_subcommands_help_exits_0(
        name: str, capfd: pytest.CaptureFixture[str]) -> None:
    assert _help(fineslab_main, [name, "--help"]) == 0
    assert "usage:" in capfd.readouterr().out.lower()


def test_fineslab_bench_lists_every_benchmark_and_runs_each_ones_help(
        capfd: pytest.CaptureFixture[str]) -> None:
    names = benchmarks()
    assert {"chaos", "engine_policy", "placer", "prefix", "serve"} <= set(names)
    assert "report" in names and all(names.values()), "each is listed with what it measures"
    assert _help(fineslab_main, ["bench"]) == 2, "no benchmark named is a usage error"
    listing = capfd.readouterr().out
    assert all(f"  {name} " in listing for name in names)
    for name in names:
        if name == "bench_serving":
            continue  # SGLang's parser in a child process: the entry-point test runs it once
        assert _help(fineslab_main, ["bench", name, "--help"]) == 0, name
        out = capfd.readouterr().out
        assert f"fineslab bench {name}" in out or f"fineslab.bench.{name} " in out, name
    assert _help(fineslab_main, ["bench", "no-such"]) == 2
    assert "unknown benchmark 'no-such'" in capfd.readouterr().err


def test_the_cpu_mode_wrapper_refuses_an_option_for_its_module() -> None:
    from fineslab.cpu_mode.forked import main

    assert main([]) == 2 and main(["--port", "1"]) == 2

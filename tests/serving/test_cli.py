"""The `fineslab` console script: usage, pass-through subcommands, `launch --dry-run`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fineslab.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_usage_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("launch", "slabs", "models", "profile"):
        assert name in out


def test_unknown_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown subcommand 'frobnicate'" in capsys.readouterr().err


def test_models_list_passes_through(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    assert "llama-tiny" in capsys.readouterr().out


def test_console_script_runs_launch_dry_run() -> None:
    script = shutil.which("fineslab") or str(Path(sys.executable).parent / "fineslab")
    result = subprocess.run([script, "launch", "--config", "examples/cpu-demo.yaml",
                             "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "placement by mme" in result.stdout

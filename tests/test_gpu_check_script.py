"""scripts/gpu_check.sh's commands parse as written, checked on CPU (issue #15: three of its four
benchmarks were given flags they do not have, and would have died on the first GPU lent).

`bash scripts/gpu_check.sh --check` parses every command it holds against the program's own
parser (`fineslab.bench.check_commands`); the negative controls feed the checker commands that
are broken in each way it knows, and expect it to name them. About 25 s, mostly pytest's
collection of the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from fineslab.bench import check_commands, pool, report

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_script_commands_all_parse() -> None:
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    names = [line.split()[1].rstrip(":") for line in lines]
    assert names == ["tests", "tests-torch", "gpu-lite", "hostlink", "layer-copy", "cuda-wake",
                     "alloc", "pool-triton", "pool-flashinfer", "precisions"], lines
    assert all(line.startswith("ok ") for line in lines), lines


def test_gpu_check_script_refuses_an_unknown_option() -> None:
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--chek"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "usage" in result.stderr, result.stderr


def test_gpu_twin_script_helps_and_refuses_before_building(tmp_path: Path) -> None:
    """scripts/gpu_twin.sh builds 5 GB: its help, a bad option and a missing Python 3.12 are
    answered before anything is built or downloaded."""
    helped = subprocess.run(["bash", "scripts/gpu_twin.sh", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)
    assert helped.returncode == 0 and "CPU twin" in helped.stdout, helped.stdout + helped.stderr
    bad = subprocess.run(["bash", "scripts/gpu_twin.sh", "--stagez", "env"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "usage" in bad.stderr, bad.stderr
    not_312 = tmp_path / "python3.12"
    not_312.write_text("#!/bin/sh\nexit 1\n")  # a Python 3.12 that is not one
    not_312.chmod(0o755)
    no_python = subprocess.run(
        ["bash", "scripts/gpu_twin.sh", "--venv", str(tmp_path / "twin")], cwd=REPO,
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHON312": str(not_312)})
    assert no_python.returncode == 2 and "no Python 3.12" in no_python.stderr, no_python.stderr
    assert not (tmp_path / "twin").exists(), "nothing is built without Python 3.12"


@pytest.mark.parametrize(("entry", "why"), [
    ("bad-flag|fineslab.bench.alloc --no-such-flag --json", "unrecognized arguments"),
    ("bad-value|fineslab.bench.alloc --device tpu", "invalid choice"),
    ("cross-rule|fineslab.bench.pool --device cpu --attention-backend triton",
     "not with --device cpu"),
    ("no-module|fineslab.bench.no_such_bench --json", "cannot import"),
    ("unparsable|fineslab.errors --json", "no build_parser()"),
    ("no-tests|pytest -m gpu tests/test_layout.py -q", "exited 5"),
    ("bad-path|pytest -m gpu tests/no_such_folder -q", "exited 4"),
])
def test_checker_names_a_broken_command(entry: str, why: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    good = "alloc|fineslab.bench.alloc --device cuda --json"
    assert check_commands.main([good, entry]) == 1, f"{entry} is reported broken"
    out = capsys.readouterr()
    name = entry.split("|")[0]
    broken = [line for line in out.out.splitlines() if line.startswith("BROKEN")]
    assert len(broken) == 1 and broken[0].startswith(f"BROKEN {name}:"), out.out
    assert why in broken[0], f"the reason is given: {broken[0]}"
    assert name in out.err and "alloc" not in out.err, out.err


def test_checker_refuses_an_entry_without_a_name() -> None:
    with pytest.raises(SystemExit) as info:
        check_commands.main(["fineslab.bench.alloc --json"])
    assert info.value.code == 2


@pytest.mark.parametrize(("device", "has_cuda", "labels"), [
    ("auto", False, ["cpu torch_native"]),
    ("auto", True, ["cpu torch_native", "cuda triton", "cuda flashinfer"]),
    ("cpu", True, ["cpu torch_native"]),
    ("cuda", True, ["cuda triton", "cuda flashinfer"]),
])
def test_pool_bench_runs_what_device_asks_for(device: str, has_cuda: bool,
                                              labels: list[str]) -> None:
    args = pool.parse_args(["--device", device])
    runs = pool.plan_comparisons(args.device, args.backends, has_cuda)
    assert [run.label for run in runs] == labels
    assert all(run.cpu == (run.backend is None) for run in runs), "CPU runs name no backend"


def test_pool_bench_attention_backend_picks_the_cuda_runs() -> None:
    args = pool.parse_args(["--device", "cuda", "--attention-backend", "flashinfer"])
    runs = pool.plan_comparisons(args.device, args.backends, has_cuda=True)
    assert [run.backend_args for run in runs] == [("--attention-backend", "flashinfer")]


def test_report_prints_every_figure_of_every_result(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "alloc.json").write_text(json.dumps({"ratio": 1.02, "device": "cuda"}) + "\n")
    (tmp_path / "precisions.log").write_text(
        "a table\n" + json.dumps({"tokens_per_gib": {"bf16": 4096.0, "kv4": 16384.0}}) + "\n")
    assert report.main([str(tmp_path / "alloc.json"), str(tmp_path / "precisions.log")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert rows == [["alloc", "device", "cuda"], ["alloc", "ratio", "1.02"],
                    ["precisions", "tokens_per_gib.bf16", "4096"],
                    ["precisions", "tokens_per_gib.kv4", "1.638e+04"]], rows


def test_report_flags_a_result_that_is_not_json(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pool.json").write_text("Traceback (most recent call last):\n")
    assert report.main([str(tmp_path / "pool.json")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"pool +\(unreadable\) .*pool.json", out), out

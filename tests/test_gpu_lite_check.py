"""The staged device check's harness (`fineslab.gpu_lite.check`), on CPU: a stage past its time
is stopped with what it started, and the stages after it still run and report; the `env` stage
names SGLang and fineslab's plugin entry point. (The stages themselves ran on CPU as
`--device cpu`, docs/gpu.md; CI leaves their ten runtime starts to the plugin's own tests.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fineslab.gpu_lite import check
from fineslab.proctree import descendant_pids


def _servers(out: Path) -> set[int]:
    """The SGLang servers whose output goes to a log under `out`: this check's, not those the
    suite's other workers start meanwhile."""
    found = set()
    for pid in Path("/proc").iterdir():
        if pid.name.isdigit():
            try:
                if b"sglang.launch_server" in (pid / "cmdline").read_bytes() and \
                        Path(os.readlink(pid / "fd" / "1")).is_relative_to(out):
                    found.add(int(pid.name))
            except OSError:
                continue
    return found


@pytest.mark.slow  # the stopped stage begins a runtime
def test_a_stage_past_its_time_is_stopped_and_the_next_still_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    children = set(descendant_pids(os.getpid()))  # the suite's own
    code = check.main(["--device", "cpu", "--stages", "stock,env", "--timeout", "stock=4",
                       "--out", str(tmp_path)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1
    stock, env = report["stages"]["stock"], report["stages"]["env"]
    assert stock["ok"] is False and stock["error"] == "timed out after 4 s"
    assert env["ok"] is True, env
    assert "fineslab.sglang_plugin:register" in env["sglang_plugins"]
    assert env["sglang"].startswith("0.5.23")
    assert (tmp_path / "stock.log").exists() and (tmp_path / "env.json").exists()
    deadline = time.monotonic() + 30
    while _servers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _servers(tmp_path), "the stopped stage's server went with it"
    assert not set(descendant_pids(os.getpid())) - children, "no stage process left"


def test_an_unknown_stage_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        check.main(["--stages", "env,nope"])
    assert exited.value.code == 2
    assert "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.main(["--timeout", "env=-1"])
    with pytest.raises(SystemExit):
        check.main(["--timeout", "nope=3"])


def test_every_stage_is_bounded_and_named_in_the_module_doc() -> None:
    """A stage added to STAGES gets its own bound and a line in the check's stage list (the
    lent GPU's minutes are planned from them)."""
    assert set(check.TIMEOUTS_S) == set(check.STAGES), "one bound per stage"
    doc = check.__doc__ or ""
    missing = [name for name in check.STAGES if f"\n    {name} " not in doc]
    assert not missing, f"stages not in the module doc's list: {missing}"
    assert {"weights", "streaming"} <= set(check.STAGES)


def test_a_stage_stopped_by_sigterm_runs_its_cleanup(tmp_path: Path) -> None:
    """The weights and streaming stages, stopped past their bound (SIGTERM to their group),
    still close their arena and remove their files: their `finally` blocks run (without
    `terminable`, Python's default left /dev/shm/fineslab-gw* behind)."""
    script = (
        "import pathlib, time\n"
        "from fineslab.gpu_lite.stage_weights import terminable\n"
        "@terminable\n"
        "def stage(harness, device, out):\n"
        "    try:\n"
        "        (out / 'started').touch()\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        "        (out / 'cleaned').touch()\n"
        f"stage(None, 'cpu', pathlib.Path({str(tmp_path)!r}))\n")
    env = {**os.environ, "PYTHONPATH": str(check.REPO)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    code = child.wait(30)
    assert (tmp_path / "cleaned").exists(), "the stage's finally ran"
    assert code == 128 + signal.SIGTERM

"""Issue #15, defect 14: `python -m fineslab.sim fidelity` killed by a timeout left its SGLang
server running (reparented to init) with its shared-memory files. Every tool starts SGLang
through `fineslab.runtime`, whose lifeline takes the server down with the tool; since issue
#18 item 5 the fidelity check serves through the full stack, whose launcher holds the tool's
lifeline (`--stop-with-fd`) and stops its runtimes, router and arena when the tool is gone.
This runs the real tool, ends it as `timeout` does (SIGTERM) once the launcher's runtime has
a scheduler, and looks: no process of the tree, no arena file, no fleet folder in /tmp (the
tool turns SIGTERM into SystemExit so that its `finally` blocks stop the fleet)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fineslab.fleet import fleet_processes
from fineslab.proctree import stat_fields
from fineslab.slabs.shm import default_shm_dir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _descendants(root: int) -> dict[int, str]:
    """Live descendants of `root`: pid -> command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(int(entry))
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if fields and fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
            commands[int(entry)] = cmdline.decode(errors="replace")
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = commands[pid]
                frontier.append(pid)
    return found


def _fleet_tree(tool_pid: int) -> dict[int, str]:
    """The tool's descendants and its fleet's processes: runtimes are forks of the launcher's
    zygote, which leaves the launcher's tree (fineslab.zygote); they carry the fleet's marker."""
    tree = _descendants(tool_pid)
    for pid in fleet_processes(f"measure-{tool_pid}"):  # fineslab.profile.one_model's fleet id
        try:
            tree[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
    return tree


def test_fidelity_killed_by_sigterm_leaves_no_sglang_process(tmp_path: Path) -> None:
    tool = subprocess.Popen(
        [sys.executable, "-m", "fineslab.sim", "fidelity", "--quick", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        tree: dict[int, str] = {}
        while not any("sglang::scheduler" in c for c in tree.values()):
            assert tool.poll() is None, "the tool ended before its server spawned a scheduler"
            assert time.monotonic() < deadline, "no SGLang scheduler started"
            tree = _fleet_tree(tool.pid)
            time.sleep(0.5)
        assert any("sglang.launch_server" in c for c in tree.values()), tree
        assert any("fineslab.launch" in c for c in tree.values()), "the full stack, launched"
        arena = f"fineslab-measure-{tool.pid}-*"  # fineslab.profile.one_model's fleet id
        assert list(default_shm_dir().glob(arena)), f"no arena file {arena} while serving"
        tool.send_signal(signal.SIGTERM)
        tool.wait(30)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in tree):
            assert time.monotonic() < deadline, (
                "left behind: " + str({p: c[:80] for p, c in tree.items() if _alive(p)}))
            time.sleep(0.5)
        while list(default_shm_dir().glob(arena)):
            assert time.monotonic() < deadline, f"arena files left: {arena}"
            time.sleep(0.5)
        assert not _fleet_folders(tool.pid), "the fleet's folder is removed on SIGTERM"
    finally:
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
        for folder in _fleet_folders(tool.pid):
            shutil.rmtree(folder, ignore_errors=True)


def _fleet_folders(tool_pid: int) -> list[Path]:
    """The /tmp folders of the fleet the tool started (fineslab.profile.one_model)."""
    return [f for f in Path(tempfile.gettempdir()).glob("fineslab-fleet-*")
            if f"measure-{tool_pid}" in _read(f / "fleet.yaml")]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    return stat_fields(pid)[:1] not in ([], ["Z"])

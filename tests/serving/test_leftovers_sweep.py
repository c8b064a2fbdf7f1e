"""The launcher's run record and the sweep at launch (issue #15, defect 2), with stand-in trees.

A relaunch of the same config used to start a second set of runtimes beside the orphans of a
killed launcher (memory 6.2 -> 12.1 GB). Now a launch refuses a live launcher of its fleet id
and stops what a dead one left, touching only processes marked with the fleet's id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fineslab.errors import EnvironmentSetupError
from fineslab.fleet.leftovers import RunRecord, record_path, sweep
from fineslab.proctree import FLEET_MARKER, remove_dead_record, stop_group, tree_pids_of_group

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def groups() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        stop_group(proc.pid, grace_s=1.0, reap=proc.poll)


def _group(groups: list[subprocess.Popen[bytes]], fleet_id: str | None) -> int:
    env = dict(os.environ)
    if fleet_id is not None:
        env[FLEET_MARKER] = fleet_id
    proc = subprocess.Popen(SLEEPER, env=env, start_new_session=True)
    groups.append(proc)
    return proc.pid


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_record(path: Path, launcher_pid: int, pgids: list[int],
                  files: list[str] = ()) -> None:  # type: ignore[assignment]
    runtimes = {f"r{i}": {"pgid": pgid, "shm_files": list(files)} for i, pgid in enumerate(pgids)}
    path.write_text(json.dumps({"launcher": [launcher_pid, 0], "runtimes": runtimes}))


def test_a_dead_launchers_marked_runtimes_are_stopped_and_unmarked_ones_left(
        tmp_path: Path, groups: list[subprocess.Popen[bytes]]) -> None:
    ours, stranger, other_fleet = (_group(groups, "sweepme"), _group(groups, None),
                                   _group(groups, "another"))
    path = record_path("sweepme", tmp_path)
    _write_record(path, _dead_pid(), [ours, stranger, other_fleet])
    said: list[str] = []
    record = sweep("sweepme", tmp_path, progress=said.append)
    deadline = time.monotonic() + 10
    while tree_pids_of_group(ours) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tree_pids_of_group(ours), "the orphaned runtime of this fleet is stopped"
    assert tree_pids_of_group(stranger), "a process without the fleet marker is never touched"
    assert tree_pids_of_group(other_fleet), "nor another fleet's"
    assert said and "1 process(es)" in said[0], said
    assert json.loads(path.read_text())["launcher"][0] == os.getpid(), "a fresh record"
    record.remove()
    assert not path.exists()


def test_a_live_launcher_of_the_same_fleet_refuses_the_launch(
        tmp_path: Path, groups: list[subprocess.Popen[bytes]]) -> None:
    launcher = _group(groups, None)
    _write_record(record_path("busy", tmp_path), launcher, [])
    with pytest.raises(EnvironmentSetupError, match=f"already running .*pid {launcher}"):
        sweep("busy", tmp_path)


def test_recorded_sglang_files_are_removed(tmp_path: Path) -> None:
    leftover = Path(f"/dev/shm/sem.mp-sweeptest{os.getpid()}")
    leftover.write_bytes(b"x")
    _write_record(record_path("files", tmp_path), _dead_pid(), [0], [str(leftover)])
    sweep("files", tmp_path, progress=lambda _: None)
    assert not leftover.exists()


def test_an_unreadable_record_is_replaced(tmp_path: Path) -> None:
    record_path("junk", tmp_path).write_text("{not json")
    record = sweep("junk", tmp_path)
    assert isinstance(record, RunRecord)
    record.note_runtime("r0", 1234, set())
    assert json.loads(record.path.read_text())["runtimes"]["r0"]["pgid"] == 1234


def test_a_dead_launchers_host_copy_folder_is_removed_and_no_other(tmp_path: Path) -> None:
    fleet_id = f"folders{os.getpid()}"
    mine = tmp_path / f"fineslab-{fleet_id}-weights-abc"
    other = tmp_path / "fineslab-another-weights-abc"  # not this fleet's: a forged record
    for folder in (mine, other):
        folder.mkdir()
        (folder / "m.weights").write_bytes(b"w")
    path = record_path(fleet_id, tmp_path)
    _write_record(path, _dead_pid(), [0], [])
    body = json.loads(path.read_text())
    path.write_text(json.dumps({**body, "folders": [str(mine), str(other)]}))
    sweep(fleet_id, tmp_path, progress=lambda _: None)
    assert not mine.exists() and other.exists()


def test_the_last_of_a_dead_launchers_fleet_removes_its_record_and_folders(
        tmp_path: Path, groups: list[subprocess.Popen[bytes]]) -> None:
    """#39: after a SIGKILL of the launcher its record and host-copy folders stayed until a
    relaunch swept them; the runtimes' lifelines remove them once nothing of the fleet but
    lifelines runs (`remove_dead_record`), never while a launcher or a runtime lives."""
    fleet_id = f"lastout{os.getpid()}"
    folder = tmp_path / f"fineslab-{fleet_id}-weights-abc"
    folder.mkdir()
    path = record_path(fleet_id, tmp_path)

    def record(launcher: int) -> None:
        path.write_text(json.dumps({"launcher": [launcher, 0], "runtimes": {},
                                    "folders": [str(folder)]}))

    record(_group(groups, None))  # a live launcher (a start time of 0 matches any pid)
    assert not remove_dead_record(fleet_id, shm_dir=tmp_path) and path.exists()
    record(_dead_pid())
    runtime = _group(groups, fleet_id)
    started = time.monotonic()
    assert not remove_dead_record(fleet_id, wait_s=0.5, shm_dir=tmp_path), "a runtime runs"
    assert time.monotonic() - started >= 0.5 and path.exists() and folder.exists()
    stop_group(runtime, grace_s=1.0, reap=groups[-1].poll)
    assert remove_dead_record(fleet_id, shm_dir=tmp_path)
    assert not path.exists() and not folder.exists()
    assert not remove_dead_record(fleet_id, shm_dir=tmp_path), "gone already: nothing to do"

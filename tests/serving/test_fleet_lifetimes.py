"""A fleet's lifetime at its edges (issue #15): a second launch, a busy port, the launcher killed
with SIGKILL, the relaunch, and Ctrl-C. One real SGLang runtime (the demo's llama-bf16), real
processes and shared memory; the checks run in file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_support import REPO, LaunchedFleet, group_alive, launch, shm_files

from fineslab.bench.chaos_fleet import fleet_processes
from fineslab.env import SHARED_ZYGOTE_VAR
from fineslab.fleet import FleetHandle
from fineslab.lifeline import remove_dead_fleet_files
from fineslab.proctree import stat_fields
from fineslab.runtime import free_port

pytestmark = pytest.mark.slow

MODELS = ("llama-bf16",)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lifetimes")


@pytest.fixture(scope="module")
def fleet_id() -> str:
    return f"life-{os.getpid()}"


@pytest.fixture(scope="module")
def first(folder: Path, model_cache: Path, fleet_id: str) -> Iterator[LaunchedFleet]:
    fleet, _ = launch("cpu-demo.yaml", folder, model_cache, fleet_id, models=MODELS)
    yield fleet
    if fleet.proc.poll() is None:
        os.killpg(fleet.proc.pid, signal.SIGKILL)


def _one_model_demo(fleet_id: str, port: int | None = None) -> dict[str, Any]:
    """The demo's config with its first model only, as `fleet_id` (on `port` if given)."""
    import yaml

    config = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())
    config.update(fleet_id=fleet_id, models=config["models"][:1])
    if port is not None:
        config["router"]["port"] = port
    return dict(config)


def _launch_fails(folder: Path, fleet_id: str, port: int, name: str) -> tuple[int, str, float]:
    import yaml

    config = _one_model_demo(fleet_id, port)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    start_s = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fineslab.launch", "--config", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start_s


def test_a_second_launch_of_a_running_fleet_is_refused(first: LaunchedFleet, folder: Path,
                                                       fleet_id: str) -> None:
    # Defect 2: relaunching the same config started a second set of runtimes beside the first.
    code, out, _ = _launch_fails(folder, fleet_id, free_port(), "second")
    assert code == 2 and "already running" in out, out[-2000:]
    assert "starting 1 runtimes" not in out
    assert first.get("/health").status_code == 200, "the running fleet is untouched"


def test_a_busy_router_port_fails_the_launch_before_any_runtime_starts(
        first: LaunchedFleet, folder: Path) -> None:
    # Defect 8: the router port was checked last, after 57 s of starting runtimes.
    port = int(first.base_url.rsplit(":", 1)[1])
    code, out, took_s = _launch_fails(folder, f"other-{os.getpid()}", port, "busy")
    assert code == 2 and f"router port {port}" in out and "in use" in out, out[-2000:]
    assert "starting" not in out, "no runtime was started"
    assert took_s < 60, f"the launch took {took_s:.0f} s to fail"


def test_killing_the_launcher_takes_its_runtimes_and_shared_memory_with_it(
        first: LaunchedFleet, fleet_id: str) -> None:
    # Defect 2: after kill -9 of the launcher every SGLang process kept running and listening.
    runtime_groups = list(first.runtime_pids().values())
    record = json.loads(Path(f"/dev/shm/fineslab-{fleet_id}.run").read_text())
    sglang_files = [f for r in record["runtimes"].values() for f in r["shm_files"]]
    assert sglang_files, record
    os.kill(first.proc.pid, signal.SIGKILL)  # the launcher alone, not its process group
    first.proc.wait(30)
    record_file = Path(f"/dev/shm/fineslab-{fleet_id}.run")
    deadline = time.monotonic() + 60
    # #39: the run record stayed until a relaunch swept it; the last lifeline out removes it
    while any(group_alive(g) for g in runtime_groups) or shm_files(fleet_id) or \
            record_file.exists():
        assert time.monotonic() < deadline, (
            f"left after 60 s: groups {[g for g in runtime_groups if group_alive(g)]}, "
            f"arena files {shm_files(fleet_id)}, run record {record_file.exists()}")
        time.sleep(0.5)
    assert not [f for f in sglang_files if Path(f).exists()], "SGLang's shm files are removed"


def test_a_relaunch_after_a_killed_launcher_serves_and_ctrl_c_stops_it_fast(
        first: LaunchedFleet, folder: Path, model_cache: Path, fleet_id: str) -> None:
    fleet, _ = launch("cpu-demo.yaml", folder, model_cache, fleet_id, models=MODELS,
                      name="relaunch", log_dir=False)
    logs = re.search(r"logs in (\S+)\)", fleet.output.read_text())
    assert logs and Path(logs.group(1)).is_dir(), fleet.output.read_text()[-3000:]
    try:
        assert fleet.health()["status"] == "ok"
        groups = list(fleet.runtime_pids().values())
        start_s = time.monotonic()
        os.kill(fleet.proc.pid, signal.SIGINT)
        assert fleet.proc.wait(120) == 0, fleet.output.read_text()[-3000:]
        stop_s = time.monotonic() - start_s
    finally:
        if fleet.proc.poll() is None:
            os.killpg(fleet.proc.pid, signal.SIGKILL)
    assert not [g for g in groups if group_alive(g)]
    assert not shm_files(fleet_id) and not Path(f"/dev/shm/fineslab-{fleet_id}.run").exists()
    # Defect 11: Ctrl-C took 9.5-24.5 s, runtimes stopped one by one, silently.
    out = fleet.output.read_text()
    assert "stopping 1 runtime(s)" in out and "runtime llama-bf16-r0 stopped after" in out, out
    assert stop_s < 15, f"Ctrl-C took {stop_s:.1f} s"
    # Defect 11: the launcher's temporary log folder was left in /tmp after a clean stop.
    assert not Path(logs.group(1)).exists(), f"{logs.group(1)} left after a clean stop"


HARNESS = """
import os, subprocess, sys, time
read_end, _ = os.pipe()
with open(sys.argv[2], "wb") as out:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fineslab.launch", "--config", sys.argv[1],
         "--stop-with-fd", str(read_end), "--log-dir", sys.argv[3]], pass_fds=(read_end,),
        stdout=out,
        stderr=subprocess.STDOUT, start_new_session=True)
print(launcher.pid, flush=True)
time.sleep(3600)
"""


def test_a_harness_killed_mid_start_takes_the_fleet_it_started_with_it(
        folder: Path, model_cache: Path) -> None:
    # The test suite's own launchers were orphaned when pytest was killed: --stop-with-fd.
    import yaml

    fleet_id = f"harness-{os.getpid()}"
    config = _one_model_demo(fleet_id, free_port())
    path, output = folder / "harness.yaml", folder / "harness.out"
    path.write_text(yaml.safe_dump(config))
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(path), str(output),
                                str(folder / "harness-logs")],
                               stdout=subprocess.PIPE, cwd=REPO, start_new_session=True,
                               env=dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache)))
    try:
        assert harness.stdout is not None
        launcher = int(harness.stdout.readline())
        deadline = time.monotonic() + 300
        while not fleet_processes(fleet_id) or b"starting 1 runtimes" not in output.read_bytes():
            assert time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # the runtime is starting: SGLang is importing
        os.kill(harness.pid, signal.SIGKILL)
        harness.wait(30)
        deadline = time.monotonic() + 90
        while fleet_processes(fleet_id) or shm_files(fleet_id):
            assert time.monotonic() < deadline, (
                f"left after 90 s: {fleet_processes(fleet_id)}, {shm_files(fleet_id)}\n"
                + output.read_text()[-3000:])
            time.sleep(0.5)
    finally:
        for pid in fleet_processes(fleet_id):
            os.kill(pid, signal.SIGKILL)
        harness.kill()
    out = output.read_text()
    assert "stopping the fleet" in out and "fleet stopped" in out, out[-3000:]
    deadline = time.monotonic() + 30
    while stat_fields(launcher)[:1] not in ([], ["Z"]):
        assert time.monotonic() < deadline, "the launcher did not exit after its fleet stopped"
        time.sleep(0.2)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def _without_the_suites_zygote() -> dict[str, str]:
    """This process's environment but the suite's zygote (conftest.py): a launcher's own."""
    return {k: v for k, v in os.environ.items() if k != SHARED_ZYGOTE_VAR}


def test_a_launcher_killed_while_its_zygote_imports_leaves_no_arena(
        folder: Path, model_cache: Path) -> None:
    """kill -9 of the launcher alone after it made its arena, while its zygote still imports
    SGLang (or has just finished) and no runtime's lifeline runs yet: the zygote is the fleet's
    last process out. Before, it died of its closed stdout pipe and left the arena and the run
    record."""
    import yaml

    fleet_id = f"zygote-only-{os.getpid()}"
    config = _one_model_demo(fleet_id, free_port())
    path, output = folder / "zygote-only.yaml", folder / "zygote-only.out"
    path.write_text(yaml.safe_dump(config))
    with open(output, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "fineslab.launch", "--config",
                                     str(path), "--log-dir", str(folder / "zygote-only-logs")],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True,
                                    env={**_without_the_suites_zygote(),
                                         "FINESLAB_MODEL_CACHE": str(model_cache)})
    record = Path(f"/dev/shm/fineslab-{fleet_id}.run")
    try:
        deadline = time.monotonic() + 300
        while b"starting 1 runtimes" not in output.read_bytes():
            assert launcher.poll() is None and time.monotonic() < deadline, \
                output.read_text()[-3000:]
            time.sleep(0.2)
        assert shm_files(fleet_id) and record.exists()
        # The zygote's --socket names its folder: NUL-separated while it imports, spaces once
        # it titled itself ready (a loaded machine may get there before this line). Looked for
        # until found: at load 7 a second look, just after one that found a process of the
        # fleet, found none (the zygote's starter exits once it forked the zygote off).
        zygote_folders: list[Path] = []
        while not zygote_folders:
            assert launcher.poll() is None and time.monotonic() < deadline, \
                output.read_text()[-3000:]
            sockets = [re.search(rb"--socket[\0 ]([^\0 ]+)", _cmdline(pid))
                       for pid in fleet_processes(fleet_id)]
            zygote_folders = [Path(m.group(1).decode()).parent for m in sockets if m]
            time.sleep(0.05)
        assert all(f.exists() for f in zygote_folders), zygote_folders
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: its zygote lives on
        launcher.wait(30)
        deadline = time.monotonic() + 90
        while fleet_processes(fleet_id) or shm_files(fleet_id) or record.exists() or \
                any(f.exists() for f in zygote_folders):
            assert time.monotonic() < deadline, (
                f"left after 90 s: {fleet_processes(fleet_id)}, {shm_files(fleet_id)}, "
                f"run record {record.exists()}, zygote folders {zygote_folders}")
            time.sleep(0.5)
    finally:  # what a failed assertion above left: SIGKILLed, then swept as a relaunch would
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in fleet_processes(fleet_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        remove_dead_fleet_files(fleet_id, record_wait_s=0)


def test_a_start_interrupted_while_waiting_leaves_no_fleet(folder: Path,
                                                           model_cache: Path) -> None:
    """Ctrl-C in a notebook's cell while FleetHandle waits for ready (#39 finding 6): the
    launcher lives in a session of its own and the notebook's kernel lives on, so before, its
    runtimes kept running until the kernel went."""
    fleet_id = f"interrupted-{os.getpid()}"
    config = _one_model_demo(fleet_id)
    seen: list[int] = []

    def interrupt_once_runtimes_run(line: str) -> None:
        deadline = time.monotonic() + 120
        while line.startswith("starting 1 runtimes") and not seen:
            seen.extend(p for p in fleet_processes(fleet_id) if p not in seen)
            assert time.monotonic() < deadline, "no runtime process appeared"
            time.sleep(0.2)
        if seen:
            time.sleep(2)  # the runtime is starting: SGLang is importing
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            FleetHandle.launch(config, folder, "interrupted", cwd=REPO, timeout_s=300,
                               env=dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache)),
                               progress=interrupt_once_runtimes_run)
        assert seen, "the interruption came while the fleet's processes ran"
        deadline = time.monotonic() + 60
        record = Path(f"/dev/shm/fineslab-{fleet_id}.run")
        while fleet_processes(fleet_id) or shm_files(fleet_id) or record.exists():
            assert time.monotonic() < deadline, (
                f"left after 60 s: {fleet_processes(fleet_id)}, {shm_files(fleet_id)}, "
                f"run record {record.exists()}")
            time.sleep(0.5)
    finally:
        for pid in fleet_processes(fleet_id):
            os.kill(pid, signal.SIGKILL)

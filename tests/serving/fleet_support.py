"""Launching a fleet YAML with `python -m fineslab.launch` as a real subprocess, for the tests.

`launch(example, folder, model_cache)` copies an example config with its own fleet id and a
free router port and starts it through `fineslab.fleet.FleetHandle` (a new session, so the
test can signal the whole group; stopped if pytest dies); `LaunchedFleet` adds /metrics.
`group_alive` and `shm_files` check that a stopped fleet left nothing behind; `Hog`
fills a fleet's arena; `execute_notebook` runs one of examples/*.ipynb top to bottom.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from fineslab.fleet import FleetHandle
from fineslab.proctree import tree_pids_of_group

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900.0


class LaunchedFleet(FleetHandle):
    """A fleet of one of examples/*.yaml, launched for a test (`launch`)."""

    model_cache: Path

    def metrics(self) -> str:
        return self.get("/metrics").text


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process of process group `pgid` is left."""
    return bool(tree_pids_of_group(pgid))


def shm_files(fleet_id: str) -> list[str]:
    """The fleet's arena files (its run record is `fineslab-<fleet_id>.run`, not matched)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"fineslab-{fleet_id}-*"))


def launch(example: str, folder: Path, model_cache: Path, fleet_id: str,
           timeout_s: float = START_TIMEOUT_S, models: tuple[str, ...] | None = None,
           port: int | None = None, name: str = "launch",
           log_dir: bool = True, edit: Callable[[dict[str, Any]], None] | None = None,
           ) -> tuple[LaunchedFleet, float]:
    """Start `examples/<example>` under `fleet_id` (only `models`, when given; runtime logs in
    `folder/logs`, or without `log_dir` in the launcher's own temporary folder); return the
    fleet and its start seconds (fineslab.fleet.FleetHandle; config and output in
    `folder/<name>.yaml|out`). `edit` may change the config first."""
    config = yaml.safe_load((REPO / "examples" / example).read_text())
    config["fleet_id"] = fleet_id
    if models is not None:
        config["models"] = [m for m in config["models"] if m["name"] in models]
    if edit is not None:
        edit(config)
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(model_cache))
    env.pop("OMP_NUM_THREADS", None)  # the suite's one thread (conftest): the launcher's own
    fleet = LaunchedFleet.launch(config, folder, name, port=port, env=env, cwd=REPO,
                                 log_dir=folder / "logs", own_log_dir=not log_dir,
                                 timeout_s=timeout_s)
    fleet.model_cache = model_cache
    assert fleet.ready_s is not None
    return fleet, fleet.ready_s


@contextlib.contextmanager
def launched(example: str, folder: Path, model_cache: Path, fleet_id: str,
             stop_signal: int, edit: Callable[[dict[str, Any]], None] | None = None,
             ) -> Iterator[tuple[LaunchedFleet, float]]:
    """`launch`, and at exit `stop_signal` to a launcher still running (a shutdown test that
    did not run or failed leaves it up)."""
    fleet, start_s = launch(example, folder, model_cache, fleet_id, edit=edit)
    try:
        yield fleet, start_s
    finally:
        if fleet.proc.poll() is None:
            os.killpg(fleet.proc.pid, stop_signal)
            fleet.proc.wait(120)


class Hog:
    """The free slabs of a launched fleet's CPU arena that weights can take (all but slab 0)
    but `leave`, held by the test process as weights (a real owner in the slab table), the way
    another model's weights would."""

    def __init__(self, fleet: LaunchedFleet, leave: int = 0) -> None:
        from fineslab.slabs import SlabArena
        from fineslab.slabs.weights import WeightRegion, free_weight_slabs

        self.arena = SlabArena.attach(fleet.fleet_id, "cpu:0")
        take = free_weight_slabs(self.arena.table) - leave
        assert take > 0
        self.region = WeightRegion(self.arena.table, self.arena.paths.data, "test-hog",
                                   take * self.arena.spec.slab_bytes)
        self.region.back()

    def close(self) -> None:
        self.region.close()
        self.arena.close()


def assert_no_slab_leaked(fleet: LaunchedFleet) -> None:
    """The fleet's CPU arena passes its integrity check and no dead owner holds a slab."""
    from fineslab.slabs import SlabArena, check_integrity, snapshot

    with SlabArena.attach(fleet.fleet_id, "cpu:0") as arena:
        check_integrity(arena.table)
        dead = [o.runtime_id for o in snapshot(arena.table).owners if not o.alive]
    assert dead == [], f"slabs still held by dead owners: {dead}"


def execute_notebook(name: str, environ: dict[str, str]) -> str:
    """Run examples/`name` top to bottom in a kernel with `environ` added to this process's
    environment (the kernel inherits it); the text of all its outputs."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(REPO / "examples" / name, as_version=4)
    # Only the launchers this notebook started carry its mark (the kernel's environment is
    # theirs): stopping every launcher that appeared meanwhile stopped another suite's fleet,
    # and the whole suite with it, when two ran on one machine.
    mark = f"{NOTEBOOK_MARK}={uuid.uuid4().hex}"
    try:
        with mock.patch.dict(os.environ, {**environ, NOTEBOOK_MARK: mark.split("=", 1)[1]}):
            NotebookClient(notebook, timeout=1200, kernel_name="python3",
                           resources={"metadata": {"path": str(REPO / "examples")}}).execute()
    finally:
        _stop_launchers({pid: group for pid, group in _launchers().items()
                         if _carries(pid, mark)})
    return "".join(o.get("text", "") for cell in notebook.cells
                   for o in cell.get("outputs", []))


NOTEBOOK_MARK = "FINESLAB_TEST_NOTEBOOK"


def _carries(pid: int, variable: str) -> bool:
    """Whether process `pid`'s environment holds `variable` (NAME=value)."""
    try:
        return variable.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _launchers() -> dict[int, int]:
    """Running `python -m fineslab.launch` processes: pid -> process group."""
    import psutil

    found: dict[int, int] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "fineslab.launch" in cmdline:
            with contextlib.suppress(OSError):
                found[proc.info["pid"]] = os.getpgid(proc.info["pid"])
    return found


def _stop_launchers(launchers: dict[int, int]) -> None:
    """Stop the fleets a notebook started and left running (a cell failed before its stop
    cell): a CI run's elastic notebook failed and its five runtimes, asleep, spun at 30% of a
    core each for the rest of the suite, which ran 3-4 times slower."""
    for group in set(launchers.values()):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(_alive(pid) for pid in launchers):
        time.sleep(1)
    for group in set(launchers.values()):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its parent, is not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

"""What a launcher leaves to be swept if it dies: its run record, and the sweep at the next launch.

    /dev/shm/fineslab-<fleet_id>.run     {"launcher": [pid, start_ticks],
                                          "runtimes": {runtime_id: {"pgid": N,
                                                                    "shm_files": [...],
                                                                    "members": [[pid, ticks]]}},
                                          "folders": [the elastic models' host-copy folder],
                                          "router": "http://host:port" once it serves}

The launcher writes the record at start and again whenever a runtime (re)starts, and removes it
on a clean stop; after a SIGKILL of the launcher, the last runtime's lifeline to stop its tree
removes it and the folders it names (`fineslab.proctree.remove_dead_record`). Runtimes die
with their launcher on their own (`fineslab.lifeline`); the record is the second line of
defence, for what the lifeline cannot cover (a wrapper killed or stopped
together with the launcher, files of a tree SIGKILLed whole). At the next launch of the same
`fleet_id`:

- a record whose launcher is alive means the fleet is already running: the launch is refused,
  naming its pid (a second set of runtimes beside the first is what an orphaned fleet did);
- otherwise every process of a recorded group that carries this fleet's marker in its
  environment (`FINESLAB_FLEET_ID=<fleet_id>`, which the launcher gives every runtime), or is
  one of the runtime's recorded members (pid and start time: a runtime forked from the zygote
  shows its title where /proc shows the environment), is stopped (a pgid reused by an
  unrelated program is never touched), the recorded SGLang shm files
  are removed, the recorded folders (`$TMPDIR/fineslab-<fleet_id>-weights-*`) too, and the
  record goes.

Arena files of a dead launcher are reclaimed by `SlabArena.create` itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from fineslab.errors import EnvironmentSetupError
from fineslab.jsonfile import write_json_whole
from fineslab.proctree import (
    ProcessIdentity,
    carries_marker,
    remove_files,
    run_record_path,
    stop_group,
    tree_pids_of_group,
)
from fineslab.slabs.shm import shm_stem

logger = logging.getLogger(__name__)

def record_path(fleet_id: str, shm_dir: Path | None = None) -> Path:
    shm_stem(fleet_id, "run")  # a ConfigError for a fleet id no file name can hold
    return run_record_path(fleet_id, shm_dir)


@dataclass
class RunRecord:
    """The launcher's record of its runtimes' process groups and SGLang shm files."""

    fleet_id: str
    path: Path
    launcher: ProcessIdentity = field(default_factory=ProcessIdentity.current)
    runtimes: dict[str, dict[str, object]] = field(default_factory=dict)
    #: Folders of the fleet's own (elastic models' host copies of their weights).
    folders: list[str] = field(default_factory=list)
    #: The fleet's router, once it serves (`fineslab ctl` and `top` find it here).
    router_url: str | None = None

    def note_folder(self, folder: Path) -> None:
        self.folders.append(str(folder))
        self.write()

    def note_router(self, url: str) -> None:
        self.router_url = url
        self.write()

    def note_runtime(self, runtime_id: str, pgid: int, shm_files: set[Path],
                     members: Collection[int] = ()) -> None:
        """`members`: the tree's pids once healthy, recorded with their start times: a
        runtime forked from the zygote shows its title, not its environment, in /proc."""
        identities = [ProcessIdentity.of(pid) for pid in sorted(members)]
        self.runtimes[runtime_id] = {
            "pgid": pgid, "shm_files": sorted(map(str, shm_files)),
            "members": [[m.pid, m.start_ticks] for m in identities if m and m.start_ticks]}
        self.write()

    def write(self) -> None:
        body: dict[str, object] = {"launcher": [self.launcher.pid, self.launcher.start_ticks],
                                   "runtimes": self.runtimes, "folders": self.folders}
        if self.router_url is not None:
            body["router"] = self.router_url
        write_json_whole(self.path, body)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _known(pid: int, known: set[ProcessIdentity]) -> bool:
    """Whether `pid` is a recorded member still running (same pid, same start time)."""
    return any(m.pid == pid and m.is_alive() for m in known)


def sweep(fleet_id: str, shm_dir: Path | None = None,
          progress: Callable[[str], None] = logger.info) -> RunRecord:
    """Clear what a dead launcher of `fleet_id` left, refuse a live one; return a new record.

    Raises EnvironmentSetupError when the fleet's launcher is still running.
    """
    path = record_path(fleet_id, shm_dir)
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        old = None
    except (OSError, ValueError) as exc:
        logger.warning("unreadable run record %s (%s); replacing it", path, exc)
        old = None
    if old is not None:
        launcher = ProcessIdentity(*old.get("launcher", [0, 0]))
        if launcher.pid and launcher.pid != os.getpid() and launcher.is_alive():
            raise EnvironmentSetupError(
                f"fleet {fleet_id!r} is already running (launcher pid {launcher.pid}); stop it "
                "first, or give this fleet another fleet_id")
        _sweep_runtimes(fleet_id, old.get("runtimes", {}), progress)
        for folder in old.get("folders", []):
            if Path(folder).name.startswith(f"fineslab-{fleet_id}-") and Path(folder).is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                progress(f"swept the folder {folder} a dead launcher of fleet {fleet_id!r} left")
    record = RunRecord(fleet_id, path)
    record.write()
    return record


def _sweep_runtimes(fleet_id: str, runtimes: dict[str, dict[str, object]],
                    progress: Callable[[str], None]) -> None:
    num_processes, files = 0, []
    for entry in runtimes.values():
        pgid = int(entry.get("pgid", 0))  # type: ignore[call-overload]
        known = {ProcessIdentity(int(pid), int(ticks))
                 for pid, ticks in entry.get("members", [])}  # type: ignore[attr-defined]
        members = [p for p in tree_pids_of_group(pgid)
                   if carries_marker(p, fleet_id) or _known(p, known)] if pgid else []
        if members:
            num_processes += len(members)
            stop_group(pgid, grace_s=1.0)
        files += [Path(f) for f in entry.get("shm_files", [])]  # type: ignore[attr-defined]
    removed = remove_files(files)
    if num_processes or removed:
        progress(f"swept what a dead launcher of fleet {fleet_id!r} left: "
                 f"{num_processes} process(es), {len(removed)} SGLang shm file(s)")

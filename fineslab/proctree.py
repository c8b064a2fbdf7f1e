"""Process trees: their members, stopping them whole, and SGLang's shared-memory leftovers.

A server tree is one process group (its leader started in a new session). `stop_group` stops
it: SIGTERM to every member, then, after the grace period, SIGKILL to every member but
multiprocessing's resource tracker, which gets a moment to unlink the semaphores it tracks
once the others are gone (it ignores SIGTERM and exits when its clients have), and only then
SIGKILL. Killing the tracker together with the rest is what leaked `sem.mp-*` files.

An SGLang 0.5.23 server leaves files in /dev/shm that nobody removes when it is killed:

    sglang_loads_<name>_<hash>.shm   the scheduler's load snapshot (managers/load_snapshot.py)
    sem.mp-<random>                  multiprocessing semaphores of its spawned children; the
                                     resource tracker that would unlink them dies with the tree
    <temporary folder>/tmpXXXXXXXX   its ZMQ endpoints' IPC sockets (six a server), bound at
                                     `tempfile.NamedTemporaryFile` names (`IPC_SOCKET_PATTERN`)

They are named from random or hashed parts, so they cannot be told apart by name from another
server's. They can by use: while a process of the tree lives, it maps them (semaphores and the
snapshot are mmap'd) or holds them open, or has bound them (the sockets, by inode in
/proc/net/unix). `tree_shm_files(pids)` reads that from /proc;
`ServerProcess` records it once the server is healthy (and again on each stop), and the
lifeline wrapper (`fineslab.lifeline`) records it while it waits, so either can remove the files
after the tree is gone, even when it was killed with SIGKILL. An in-process `sglang.Engine`
leaves the same two files at `shutdown()`: `fineslab.runtime.shutdown_engine` removes them.

Only names matching `LEFTOVER_PATTERNS` are ever removed: fineslab's own arena files
(`fineslab-*`), which every runtime maps, are the launcher's to remove.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
#: Environment variable the launcher gives each runtime of a fleet (value: the fleet id), so its
#: processes can be told apart from any other program's by a later sweep.
FLEET_MARKER = "FINESLAB_FLEET_ID"
LEFTOVER_PATTERNS = ("sglang_loads_*", "sem.mp-*", "sgl_shm_*", "multi_tokenizer_args_*")


#: SGLang 0.5.23 names each ZMQ endpoint of a server `ipc://` + a `tempfile.NamedTemporaryFile(
#: delete=False)` name: six sockets `tmpXXXXXXXX` in the temporary folder per server start,
#: which nothing unlinks when the tree is killed (a run of the test suite left hundreds).
#: Removed only when the tree's own processes had them bound (by inode, /proc/net/unix) and
#: they are still sockets.
IPC_SOCKET_PATTERN = "tmp????????"


def is_leftover_name(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in LEFTOVER_PATTERNS)


def is_leftover_path(path: Path) -> bool:
    """A leftover's name in /dev/shm, or an IPC socket's in the temporary folder."""
    if path.parent == SHM_DIR:
        return is_leftover_name(path.name)
    return (path.parent == Path(tempfile.gettempdir())
            and fnmatch.fnmatchcase(path.name, IPC_SOCKET_PATTERN))


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (0: state, 1: ppid, 2: pgrp, 11-12: utime and
    stime in clock ticks); empty when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_name(pid: int) -> str:
    """The process's name (/proc/<pid>/comm: SGLang names its processes `sglang::scheduler`
    and so on); empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _live_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, `stat_fields`) of every live (non-zombie) process, read from /proc."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if len(fields) > 2 and fields[0] != "Z":
                yield int(entry), fields


def _cmdline(pid: int) -> bytes:
    """The process's command line with its NULs as spaces (a fork from the zygote is titled
    with spaces where a plain start has NULs); empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def descendant_pids(root: int) -> list[int]:
    """Live (non-zombie) descendants of `root` at any depth, read from /proc."""
    children: dict[int, list[int]] = {}
    for pid, fields in _live_processes():
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def tree_pids_of_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`, read from /proc."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) == pgid]


def alive_in_group(pids: Iterable[int], pgid: int) -> set[int]:
    """Those of `pids` that are live (non-zombie) and still in process group `pgid` (a pid
    reused by another process is not): `tree_pids_of_group` restricted to `pids`, reading
    only their /proc entries, not every process's (a supervisor asks this of every runtime
    twice a second)."""
    alive = set()
    for pid in pids:
        fields = stat_fields(pid)
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            alive.add(pid)
    return alive


#: How long the resource tracker gets to clean up once the rest of its tree is gone.
TRACKER_GRACE_S = 3.0


def _is_resource_tracker(pid: int) -> bool:
    return b"multiprocessing.resource_tracker" in _cmdline(pid)


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_until(gone: Callable[[], bool], timeout_s: float, reap: Callable[[], object]) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone():
        if time.monotonic() > deadline:
            return False
        reap()
        time.sleep(0.05)
    return True


def stop_group(pgid: int, grace_s: float, exclude: int | None = None,
               reap: Callable[[], object] = lambda: None) -> bool:
    """Stop every member of process group `pgid` (but `exclude`); see the module docstring.

    `reap` is called while waiting (a parent must reap its children, or they stay zombies,
    which count as gone here anyway). Returns whether SIGKILL was needed.
    """
    def members() -> list[int]:
        return [p for p in tree_pids_of_group(pgid) if p != exclude]

    _signal_all(members(), signal.SIGTERM)
    if _wait_until(lambda: not members(), grace_s, reap):
        return False
    logger.warning("process group %d ignored SIGTERM for %.0f s; killing it", pgid, grace_s)
    _signal_all([p for p in members() if not _is_resource_tracker(p)], signal.SIGKILL)
    _wait_until(lambda: all(_is_resource_tracker(p) for p in members()), 2.0, reap)
    _wait_until(lambda: not members(), TRACKER_GRACE_S, reap)
    _signal_all(members(), signal.SIGKILL)
    _wait_until(lambda: not members(), 2.0, reap)
    return True


def _shm_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm files `pid` maps or holds open.

    By inode, not by the path /proc shows: glibc's sem_open creates a semaphore under a
    temporary name, maps it, then links it to its real name (`sem.mp-...`) and unlinks the
    temporary one, so the mapping's path is a deleted name while the inode is the file's.
    """
    return _held_inodes(pid)[0]


def _held_inodes(pid: int) -> tuple[set[int], set[int]]:
    """(inodes of the /dev/shm files `pid` maps or holds open, inodes of its sockets)."""
    prefix = str(SHM_DIR) + "/"
    inodes: set[int] = set()
    sockets: set[int] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                inodes.add(int(parts[4]))
    with contextlib.suppress(OSError):
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{fd_dir}/{fd}")
                if target.startswith(prefix):
                    inodes.add(os.stat(f"{fd_dir}/{fd}").st_ino)
                elif target.startswith("socket:["):
                    sockets.add(int(target[8:-1]))
    return inodes, sockets


def _bound_ipc_sockets(inodes: set[int]) -> set[Path]:
    """The IPC socket paths (`IPC_SOCKET_PATTERN` in the temporary folder) bound by the
    sockets of `inodes`, from /proc/net/unix (Num RefCount Protocol Flags Type St Inode Path)."""
    found: set[Path] = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        next(f, None)
        for line in f:
            parts = line.split()
            if len(parts) == 8 and parts[6].isdigit() and int(parts[6]) in inodes:
                path = Path(parts[7])
                if is_leftover_path(path) and path.parent != SHM_DIR:
                    found.add(path)
    return found


def tree_shm_files(pids: Iterable[int]) -> set[Path]:
    """The SGLang leftover files (see the module docstring) that `pids` map or hold open, and
    the IPC sockets they have bound (`IPC_SOCKET_PATTERN`)."""
    inodes: set[int] = set()
    sockets: set[int] = set()
    for pid in pids:
        held, bound = _held_inodes(pid)
        inodes |= held
        sockets |= bound
    found: set[Path] = _bound_ipc_sockets(sockets) if sockets else set()
    if not inodes:
        return found
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if is_leftover_name(entry.name) and entry.inode() in inodes:
                found.add(Path(entry.path))
    return found


def leftover_inodes() -> frozenset[int]:
    """The inodes of the files in /dev/shm with a leftover's name (one directory read, no
    /proc): what changes when a tree creates a file `tree_shm_files` would find."""
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        return frozenset(entry.inode() for entry in entries if is_leftover_name(entry.name))
    return frozenset()


def remove_files(paths: Iterable[Path]) -> list[Path]:
    """Unlink the given leftover files; returns those removed. Refuses any other name."""
    removed = []
    for path in paths:
        if not is_leftover_path(path) and not is_leftover_name(path.name):
            raise ValueError(f"{path} is not an SGLang leftover file; refusing to remove it")
        try:
            if path.parent != SHM_DIR and is_leftover_path(path) \
                    and not stat.S_ISSOCK(path.lstat().st_mode):
                continue  # an IPC name only while it is still a socket
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not remove %s: %s", path, exc)
            continue
        removed.append(path)
    return removed


def default_shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_ticks: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, _start_ticks(pid) or 0)

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """`pid`'s identity now, None when it is gone or a zombie."""
        start = _start_ticks(pid)
        return None if start is None else cls(pid, start)

    def is_alive(self) -> bool:
        start = _start_ticks(self.pid)
        if start is None:
            return False
        # 0 means "start time unknown" on either side: fall back to the pid alone.
        return 0 in (start, self.start_ticks) or start == self.start_ticks


def _start_ticks(pid: int) -> int | None:
    """The start time of `pid` from /proc, or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _alive_by_signal(pid)
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive_by_signal(pid: int) -> int | None:
    """Fallback where /proc is unreadable: alive if signal 0 reaches it (start time unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0
    return 0


def run_record_path(fleet_id: str, shm_dir: Path | None = None) -> Path:
    """A launcher's run record (`fineslab.fleet.leftovers.RunRecord`)."""
    return (shm_dir or default_shm_dir()) / f"fineslab-{fleet_id}.run"


def carries_marker(pid: int, fleet_id: str) -> bool:
    """Whether process `pid`'s environment (/proc) holds the fleet's marker."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{FLEET_MARKER}={fleet_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def fleet_processes(fleet_id: str) -> list[int]:
    """Live (non-zombie) processes carrying the fleet's marker (its runtimes, their lifelines
    and the fleet's zygote)."""
    return [pid for pid, _ in _live_processes() if carries_marker(pid, fleet_id)]


def _is_lifeline(pid: int) -> bool:
    """A runtime's `fineslab.lifeline` wrapper, plain or forked."""
    return b" -m fineslab.lifeline " in _cmdline(pid)


def remove_dead_record(fleet_id: str, wait_s: float = 0.0, shm_dir: Path | None = None) -> bool:
    """The run record of a launcher that is gone, and the folders it names, once nothing of the
    fleet runs but lifelines: each runtime's lifeline calls it once it has stopped its own tree
    after the launcher was SIGKILLed, waiting up to `wait_s` for the other trees and the
    fleet's zygote to go (before, record and folders stayed until a relaunch swept them, #39).
    A record whose launcher lives (a relaunch's too) stays, and so does one while a process of
    the fleet still runs after `wait_s` (the next launch's sweep sees to it). Lifelines and the
    caller do not count: they all end this way, and each may remove what another already did
    (the fleet's zygote calls it too). Returns
    whether the record went."""
    path = run_record_path(fleet_id, shm_dir)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = json.loads(path.read_text())
            launcher = ProcessIdentity(*record.get("launcher", [0, 0]))
            folders = [Path(f) for f in record.get("folders", [])]
        except (OSError, ValueError, TypeError, AttributeError):
            return False
        if launcher.is_alive():
            return False
        running = [p for p in fleet_processes(fleet_id)
                   if p != os.getpid() and not _is_lifeline(p)]
        if not running:
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    for folder in folders:
        if folder.name.startswith(f"fineslab-{fleet_id}-"):
            shutil.rmtree(folder, ignore_errors=True)
    path.unlink(missing_ok=True)
    return True


def running_routers(shm_dir: Path | None = None) -> dict[str, str]:
    """fleet id -> router URL of each fleet on this machine whose launcher is alive and whose
    router serves, from the launchers' run records (`fineslab.fleet.leftovers.RunRecord`):
    where `fineslab ctl` and `top` find a fleet without `--url`."""
    found = {}
    for path in sorted((shm_dir or default_shm_dir()).glob("fineslab-*.run")):
        try:
            record = json.loads(path.read_text())
            launcher = ProcessIdentity(*record["launcher"])
            url = record.get("router")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(url, str) and launcher.pid and launcher.is_alive():
            found[path.name.removeprefix("fineslab-").removesuffix(".run")] = url
    return found

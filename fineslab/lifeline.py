"""A runtime's lifeline: its process tree dies with the process that started it, even on kill -9.

    python -m fineslab.lifeline --fd N [--grace-s S] -- COMMAND ...

`ServerProcess` starts every SGLang server through this small wrapper, as the leader of a new
session (so the server, its scheduler and its detokenizer share the wrapper's process group).
The starter keeps the write end of a pipe whose read end is fd N here; nobody ever writes to
it. When the starter exits in any way (return, exception, SIGKILL, OOM kill), the kernel closes
its end and the read here sees EOF: the wrapper then stops the whole group (SIGTERM, then
SIGKILL after `--grace-s`), removes SGLang's shared-memory files of the tree
(`fineslab.proctree`) and, for a fleet's runtime, the fleet's arena files whose launcher is
gone (`remove_dead_arenas`) and, the last of the fleet out, its run record
(`fineslab.proctree.remove_dead_record`), and exits. Otherwise it waits for COMMAND and exits
with its status (a signal-killed COMMAND as 128 + signal, the shell's convention), so the
starter sees the server's own exit, having stopped what is left of the tree and removed the
files it mapped.

Why a wrapper and not `PR_SET_PDEATHSIG`: the parent-death signal fires when the *thread* that
forked the child exits, and the launcher restarts runtimes from short-lived threads; it also
reaches only the direct child, not the scheduler SGLang forks. The pipe sees the whole
process, and the group covers the whole tree. Cost: one idle Python process per runtime
(about 10 MB resident, no CPU while it waits).

Standard library only (it must start fast and import nothing heavy).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from fineslab.proctree import (
    FLEET_MARKER,
    leftover_inodes,
    remove_dead_record,
    remove_files,
    stop_group,
    tree_pids_of_group,
    tree_shm_files,
)

#: How long a lifeline whose launcher died waits for the rest of the fleet to stop before it
#: leaves the run record to the next launch's sweep.
RECORD_WAIT_S = 15.0
#: How often the wrapper looks at COMMAND while the lifeline is quiet.
POLL_S = 0.5


#: The wrapper re-reads which SGLang shm files its tree maps (every process's /proc entry for
#: the group, then the maps of each of the group's processes: tens of milliseconds) only when
#: it may have changed: at the polls that follow a new leftover-named file in /dev/shm (one
#: directory read per poll; a file is mapped just after it is created, so the poll that finds
#: it and RESCAN_POLLS after), and every RECORD_EVERY_POLLS anyway. Re-reading every few polls
#: whatever happened cost each idle runtime 2-3% of a core, and every start 60 s of re-reads
#: a poll (the whole machine's /proc each time).
RESCAN_POLLS = 2
RECORD_EVERY_POLLS = 120


def _group_others() -> list[int]:
    me = os.getpid()
    return [p for p in tree_pids_of_group(os.getpgid(0)) if p != me]


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Child(Protocol):
    """The wrapped command: a `subprocess.Popen`, or a server forked by the zygote."""

    def poll(self) -> int | None: ...


def run(fd: int, command: list[str], grace_s: float) -> int:
    return watch(fd, subprocess.Popen(command), " ".join(command[:4]), grace_s)


def watch(fd: int, child: Child, what: str, grace_s: float) -> int:
    """Wait for `child` (the group's server) while watching the lifeline `fd`; return the
    status to exit with (see the module docstring)."""
    # SIGTERM to the group (the starter's normal stop) reaches COMMAND directly; the wrapper
    # outlives it only to report its status. Set after the fork: COMMAND keeps the defaults.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    files: set[Path] = set()
    seen: frozenset[int] = frozenset()
    rescans = 0
    for polls in itertools.count():
        readable, _, _ = select.select([fd], [], [], POLL_S)
        now_seen = leftover_inodes()
        if now_seen - seen:
            rescans = 1 + RESCAN_POLLS
        seen = now_seen
        if rescans or readable or polls % RECORD_EVERY_POLLS == 0:
            rescans = max(0, rescans - 1)
            files |= tree_shm_files(_group_others())
        if readable and not os.read(fd, 1):  # EOF: the starter is gone
            print(f"fineslab.lifeline: the process that started {what} is "
                  "gone; stopping its process tree", file=sys.stderr, flush=True)
            stop_group(os.getpgid(0), grace_s, exclude=os.getpid(), reap=_reap)
            remove_files(files)
            remove_dead_fleet_files()
            return 1
        code = child.poll()
        if code is not None:
            # The server is gone (its own exit, a crash, a start-up that failed): what is left
            # of its tree serves nobody, and the files it mapped are nobody's (a failed start
            # left a sglang_loads_*.shm for every try, issue #35).
            if os.getpgid(0) == os.getpid():  # the group is the server's tree (ServerProcess)
                files |= tree_shm_files(_group_others())
                if _group_others():
                    stop_group(os.getpgid(0), grace_s, exclude=os.getpid(), reap=_reap)
                remove_files(files)
            return _exit_status(code)
    raise AssertionError("unreachable")


def remove_dead_fleet_files(fleet_id: str | None = None,
                            record_wait_s: float = RECORD_WAIT_S) -> None:
    """The fleet's arena files, once their launcher is gone (the arena is RAM on CPU), and,
    the last of the fleet out, its run record: called by each runtime's lifeline and by the
    fleet's zygote (which may be all there is of a fleet whose launcher died starting up), and
    by `FleetHandle.cleanup` (which kills the zygote too). `fleet_id` defaults to this
    process's fleet marker."""
    fleet_id = fleet_id or os.environ.get(FLEET_MARKER)
    if not fleet_id:
        return
    from fineslab.slabs.arena import remove_dead_arenas  # heavier; only on this path

    for table in remove_dead_arenas(fleet_id):
        print(f"fineslab: removed the arena {table.stem} of a dead launcher",
              file=sys.stderr, flush=True)
    if remove_dead_record(fleet_id, wait_s=record_wait_s):
        print(f"fineslab: the last of fleet {fleet_id!r} out: removed its run record",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.lifeline")
    parser.add_argument("--fd", type=int, required=True, help="read end of the lifeline pipe")
    parser.add_argument("--grace-s", type=float, default=8.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return run(args.fd, command, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())

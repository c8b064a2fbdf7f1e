"""The lifeline wrapper and process-tree cleanup (issue #15, defects 2, 6 and 14), without SGLang.

A stand-in "server" tree (a parent with a child, one of them mapping a semaphore-named file in
/dev/shm, as SGLang's spawned children do) is started through `fineslab.lifeline` by a starter
process; the tests kill the starter with SIGKILL and check that the tree and its file go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from fineslab.proctree import (
    is_leftover_name,
    remove_files,
    stop_group,
    tree_pids_of_group,
    tree_shm_files,
)

#: A parent that spawns a child; the child creates a sem.mp-* named file through a temporary
#: name (as glibc's sem_open does), maps it, and sleeps; the parent sleeps too.
TREE = textwrap.dedent("""
    import mmap, os, subprocess, sys, time
    mode = sys.argv[3] if len(sys.argv) > 3 else "stays"
    if sys.argv[1] == "parent":
        subprocess.Popen([sys.executable, __file__, "child", sys.argv[2], mode])
        if mode == "stays":
            time.sleep(600)
        time.sleep(3)  # a server that fails its start-up
        sys.exit(1)
    else:
        tmp = "/dev/shm/sem.tmp-" + sys.argv[2]
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        area = mmap.mmap(fd, 4096)
        os.link(tmp, "/dev/shm/sem.mp-" + sys.argv[2])
        os.unlink(tmp)
        time.sleep(1.5 if mode == "child-dies-first" else 600)
""")

#: Starts the tree through the lifeline, prints the wrapper's pid, then waits to be killed.
STARTER = textwrap.dedent("""
    import sys, time
    from fineslab.runtime import lifeline_read_fd
    import subprocess
    fd = lifeline_read_fd()
    wrapper = [sys.executable, "-m", "fineslab.lifeline", "--fd", str(fd), "--grace-s", "1", "--"]
    command = [sys.executable, sys.argv[1], "parent", sys.argv[2]]
    if sys.argv[3] == "bare":  # the negative control: no lifeline
        wrapper = []
    proc = subprocess.Popen(wrapper + command, start_new_session=True, pass_fds=(fd,))
    print(proc.pid, flush=True)
    time.sleep(600)
""")


def _wait(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def tree_files(tmp_path: Path) -> tuple[Path, Path, str]:
    tree = tmp_path / "tree.py"
    tree.write_text(TREE)
    starter = tmp_path / "starter.py"
    starter.write_text(STARTER)
    return tree, starter, f"fineslabtest{uuid.uuid4().hex[:10]}"


def test_killing_the_starter_with_sigkill_takes_the_whole_tree_and_its_shm_file(
        tree_files: tuple[Path, Path, str]) -> None:
    # Defect 2: after kill -9 of the launcher every SGLang process kept running and listening.
    tree, starter, tag = tree_files
    sem = Path(f"/dev/shm/sem.mp-{tag}")
    proc = subprocess.Popen([sys.executable, str(starter), str(tree), tag, "lifeline"],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        pgid = int(proc.stdout.readline())
        assert _wait(lambda: sem.exists() and len(tree_pids_of_group(pgid)) == 3, 30), \
            "wrapper, parent and child are up and the child maps its file"
        time.sleep(1.5)  # the wrapper records the tree's files on its next look
        proc.kill()
        assert _wait(lambda: not tree_pids_of_group(pgid), 20), "the tree outlived its starter"
        assert _wait(lambda: not sem.exists(), 5), "the tree's semaphore file was left"
    finally:
        proc.kill()
        remove_files([sem])


def test_negative_control_without_the_lifeline_the_tree_outlives_its_starter(
        tree_files: tuple[Path, Path, str]) -> None:
    tree, starter, tag = tree_files
    proc = subprocess.Popen([sys.executable, str(starter), str(tree), tag, "bare"],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    pgid = int(proc.stdout.readline())
    try:
        assert _wait(lambda: len(tree_pids_of_group(pgid)) == 2, 30)
        proc.kill()
        proc.wait(10)
        time.sleep(2)
        assert len(tree_pids_of_group(pgid)) == 2, "an unwrapped tree is orphaned, not stopped"
    finally:
        stop_group(pgid, grace_s=1.0)
        remove_files([Path(f"/dev/shm/sem.mp-{tag}")])


def test_the_wrapper_exits_with_its_commands_status(tmp_path: Path) -> None:
    from fineslab.runtime import lifeline_read_fd

    fd = lifeline_read_fd()
    for code, expected in (("sys.exit(3)", 3), ("os.kill(os.getpid(), 9)", 128 + 9)):
        done = subprocess.run([sys.executable, "-m", "fineslab.lifeline", "--fd", str(fd), "--",
                               sys.executable, "-c", f"import os, sys; {code}"],
                              pass_fds=(fd,), timeout=60)
        assert done.returncode == expected


def test_tree_shm_files_finds_a_semaphore_by_inode_through_its_deleted_temporary_name(
        tree_files: tuple[Path, Path, str]) -> None:
    # Defect 6: the semaphore shows under a deleted temporary name in /proc/<pid>/maps.
    tree, _, tag = tree_files
    sem = Path(f"/dev/shm/sem.mp-{tag}")
    proc = subprocess.Popen([sys.executable, str(tree), "parent", tag],
                            start_new_session=True)
    try:
        assert _wait(lambda: sem.exists() and len(tree_pids_of_group(proc.pid)) == 2, 30)
        time.sleep(0.3)
        assert tree_shm_files(tree_pids_of_group(proc.pid)) == {sem}
        assert stop_group(proc.pid, grace_s=2.0, reap=proc.poll) is False, "SIGTERM sufficed"
        assert not tree_pids_of_group(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if tree_pids_of_group(proc.pid) else None
        remove_files([sem])


def test_only_sglang_leftover_names_are_ever_removed(tmp_path: Path) -> None:
    assert is_leftover_name("sem.mp-abc") and is_leftover_name("sglang_loads_x_1234.shm")
    for name in ("fineslab-demo-cpu0.arena", "fineslab-demo.run", "sem.loky-1", "torch_1"):
        assert not is_leftover_name(name)
        with pytest.raises(ValueError, match="not an SGLang leftover"):
            remove_files([Path("/dev/shm") / name])


@pytest.mark.parametrize("mode", ["child-dies-first", "child-stays"])
def test_a_server_that_exits_on_its_own_takes_its_tree_and_shm_files_with_it(
        tree_files: tuple[Path, Path, str], mode: str) -> None:
    # Issue #35: a runtime that died starting up left a sglang_loads_*.shm for every try: its
    # scheduler had mapped the file only for a moment, and the wrapper removed nothing unless
    # its starter died.
    from fineslab.runtime import lifeline_read_fd

    tree, _starter, tag = tree_files
    sem = Path(f"/dev/shm/sem.mp-{tag}")
    fd = lifeline_read_fd()
    try:
        done = subprocess.run([sys.executable, "-m", "fineslab.lifeline", "--fd", str(fd),
                               "--grace-s", "1", "--", sys.executable, str(tree), "parent", tag,
                               mode], pass_fds=(fd,), timeout=60, start_new_session=True)
        assert done.returncode == 1, "the server's own status"
        assert not sem.exists(), "the file the tree mapped was left"
        assert not [p for p in _pids_running(str(tree))], "the tree outlived its server"
    finally:
        remove_files([sem])


def _pids_running(script: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if script in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_an_idle_wrapper_reads_its_trees_maps_only_when_dev_shm_gets_a_new_leftover(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's cost while it waits: a /proc scan of the tree (tens of milliseconds) in the
    first polls (every file in /dev/shm is new to it), then only in the polls after a new
    leftover-named file appears there (and every RECORD_EVERY_POLLS). Re-reading every few
    polls whatever happened cost each idle runtime 2-3% of a core."""
    from fineslab import lifeline

    polls, new_file_at = 60, 20
    looks = iter(range(polls + 1))
    scans: list[int] = []
    seen_at: list[int] = []

    def inodes() -> frozenset[int]:
        look = next(looks)
        seen_at.append(look)
        return frozenset({1} | ({2} if look >= new_file_at else set()))

    class Child:
        calls = 0

        def poll(self) -> int | None:
            Child.calls += 1
            return 0 if Child.calls > polls else None

    monkeypatch.setattr(lifeline, "POLL_S", 0.001)
    monkeypatch.setattr(lifeline, "leftover_inodes", inodes)
    monkeypatch.setattr(lifeline, "tree_shm_files",
                        lambda pids: scans.append(len(seen_at) - 1) or set())
    monkeypatch.setattr(lifeline, "_group_others", lambda: [])
    read_end, write_end = os.pipe()
    try:
        assert lifeline.watch(read_end, Child(), "a stand-in", 1.0) == 0
    finally:
        os.close(read_end)
        os.close(write_end)
    rescans = 1 + lifeline.RESCAN_POLLS
    assert scans == [*range(rescans), *range(new_file_at, new_file_at + rescans)], scans


def test_alive_in_group_is_tree_pids_of_group_restricted_to_the_pids_asked() -> None:
    """What a supervisor asks of every runtime twice a second, read from the pids' own /proc
    entries: the live ones still in the group; a dead one, or one of another group, is not."""
    from fineslab.proctree import alive_in_group

    leader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        members = {leader.pid, child}
        assert alive_in_group(members | {os.getpid()}, leader.pid) == members
        assert members <= set(tree_pids_of_group(leader.pid))
        os.kill(child, signal.SIGKILL)
        assert _wait(lambda: alive_in_group(members, leader.pid) == {leader.pid}, 10)
    finally:
        stop_group(leader.pid, 1.0, reap=leader.poll)
    assert _wait(lambda: not alive_in_group(members, leader.pid), 10)


def _ipc_name() -> Path:
    """A fresh name as SGLang makes its IPC endpoints' (`tmpXXXXXXXX` in the temporary folder),
    the file created empty."""
    import tempfile

    fd, name = tempfile.mkstemp()
    os.close(fd)
    return Path(name)


def test_the_trees_bound_ipc_sockets_are_found_and_removed_once_it_is_gone() -> None:
    """SGLang binds its ZMQ endpoints at `tempfile.NamedTemporaryFile(delete=False)` names (six
    sockets a server start in the temporary folder) and nothing unlinks them when the tree is
    killed: `tree_shm_files` finds those the tree has bound (by socket inode), `remove_files`
    unlinks them while they are sockets; a socket another process bound is not the tree's."""
    import socket

    bound = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import socket, sys, tempfile, time
        name = tempfile.NamedTemporaryFile(delete=False).name
        import os; os.unlink(name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(name); s.listen()
        print(name, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    others = _ipc_name()
    others.unlink()
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.bind(str(others))
    try:
        assert bound.stdout is not None
        path = Path(bound.stdout.readline().strip())
        found = tree_shm_files([bound.pid])
        assert path in found and others not in found, (path, found)
        os.kill(bound.pid, signal.SIGKILL)
        bound.wait(10)
        assert path.exists(), "SGLang's case: the killed tree leaves its socket"
        assert remove_files(found) == [path] and not path.exists()
        assert tree_shm_files([os.getpid()]) >= {others}
    finally:
        if bound.poll() is None:
            bound.kill()
        mine.close()
        others.unlink(missing_ok=True)


def test_an_ipc_name_that_is_no_longer_a_socket_is_left_alone(tmp_path: Path) -> None:
    plain = _ipc_name()
    try:
        assert remove_files([plain]) == [] and plain.exists(), "a plain file of that name"
    finally:
        plain.unlink(missing_ok=True)
    with pytest.raises(ValueError, match="refusing"):
        remove_files([tmp_path / "tmpabcdefgh"])  # the name, but not in the temporary folder

"""The zygote's mechanism with a stand-in runtime (no SGLang): what a fork is told, how its
exit is seen, how it dies, and the refusals that send a start down the plain path.

The zygote here preloads nothing (`preload=()`) and forks `echo_runtime` instead of
`sglang.launch_server`; the same code forks SGLang in tests/zygote/test_zygote_sglang.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fineslab.env import SHARED_ZYGOTE_VAR
from fineslab.proctree import (
    FLEET_MARKER,
    carries_marker,
    descendant_pids,
    stop_group,
    tree_pids_of_group,
)
from fineslab.zygote import (
    ForkedProcess,
    Zygote,
    ZygoteAbandoned,
    ZygoteUnavailable,
    serve_zygote,
    shared_zygote,
)
from fineslab.zygote.client import _served_zygote
from fineslab.zygote.protocol import ForkRequest

HERE = Path(__file__).resolve().parent
BASE_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
            FLEET_MARKER: "ztest"}


@pytest.fixture
def lifeline() -> Iterator[tuple[int, int]]:
    """A lifeline pipe of the test's own (read end, write end): closing the write end is what
    the launcher's death looks like."""
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


@pytest.fixture
def zygote(lifeline: tuple[int, int]) -> Iterator[Zygote]:
    z = Zygote(BASE_ENV, lifeline[0], preload=())
    z.start(timeout_s=60)
    yield z
    z.stop()


def _request(out: Path, action: list[str], t: str, cwd: Path, **env: str) -> ForkRequest:
    argv = [sys.executable, "-m", "echo_runtime", str(out), *action]
    return ForkRequest(module="echo_runtime", args=[str(out), *action],
                       env={**BASE_ENV, "FINESLAB_T": t, **env}, cwd=str(cwd), title=argv,
                       wrapper_title=[sys.executable, "-m", "fineslab.lifeline", "--", *argv])


def _fork(zygote: Zygote, request: ForkRequest, log: Path) -> ForkedProcess:
    with open(log, "wb") as f:
        return zygote.fork(request, f.fileno())


def _report(path: Path, timeout_s: float = 30) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no report at {path}"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_each_fork_sees_only_its_own_arguments_environment_folder_and_log(
        zygote: Zygote, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _fork(zygote, _request(tmp_path / "a.json", ["exit", "7"], "a", tmp_path / "a"),
              tmp_path / "a.log")
    b = _fork(zygote, _request(tmp_path / "b.json", ["exit", "0"], "b", tmp_path / "b"),
              tmp_path / "b.log")
    assert a.wait(30) == 7, "the runtime's own exit status comes back through the zygote"
    assert b.wait(30) == 0
    ra, rb = _report(tmp_path / "a.json"), _report(tmp_path / "b.json")
    assert (ra["t"], rb["t"]) == ("a", "b"), "each fork sees its own environment, set after it"
    assert ra["argv"][1:] == [str(tmp_path / "a.json"), "exit", "7"], ra["argv"]
    assert (ra["cwd"], rb["cwd"]) == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert ra["main"] == "__main__", "the module runs as __main__, as `python -m` runs it"
    assert ra["pgid"] == ra["sid"] == a.pid == ra["ppid"], \
        "the wrapper leads a new session and the server is its child, as in a plain start"
    assert "echo runtime a up" in (tmp_path / "a.log").read_text()
    assert "echo runtime b up" not in (tmp_path / "a.log").read_text()


def test_forks_are_titled_as_a_plain_start_and_stopped_as_one_group(
        zygote: Zygote, tmp_path: Path) -> None:
    proc = _fork(zygote, _request(tmp_path / "r.json", ["sleep"], "r", tmp_path),
                 tmp_path / "r.log")
    server_pid = int(_report(tmp_path / "r.json")["pid"])  # type: ignore[call-overload]
    try:
        assert "fineslab.lifeline" in _cmdline(proc.pid)
        assert "-m echo_runtime" in _cmdline(server_pid)
        assert "fineslab.lifeline" not in _cmdline(server_pid)
        for pid in (proc.pid, server_pid):  # what the launcher's sweep and the benches read
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"{FLEET_MARKER}=ztest".encode() in environ, \
                "the title leaves the environment block (and its fleet marker) alone"
        assert set(tree_pids_of_group(proc.pid)) == {proc.pid, server_pid}
    finally:
        stop_group(proc.pid, 2.0, reap=proc.poll)
    assert proc.wait(10) is not None
    assert not tree_pids_of_group(proc.pid)


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_proc_shows_each_forks_own_environment_whatever_the_zygotes_marker(
        zygote: Zygote, tmp_path: Path) -> None:
    """One zygote may fork for several fleets: the marker the sweeps read from /proc is the
    fork's own (written over the zygote's environment block), not the zygote's `ztest`."""
    procs = {}
    for fleet in ("fleet-a", "fleet-b"):
        procs[fleet] = _fork(zygote, _request(tmp_path / f"{fleet}.json", ["sleep"], fleet,
                                              tmp_path, **{FLEET_MARKER: fleet}),
                             tmp_path / f"{fleet}.log")
    try:
        for fleet, proc in procs.items():
            server_pid = int(_report(tmp_path / f"{fleet}.json")["pid"])  # type: ignore[call-overload]
            for pid in (proc.pid, server_pid):
                environ = _environ(pid)
                assert f"{FLEET_MARKER}={fleet}".encode() == environ[0], environ[:3]
                assert f"FINESLAB_T={fleet}".encode() in environ
                assert f"{FLEET_MARKER}=ztest".encode() not in environ
                assert carries_marker(pid, fleet) and not carries_marker(pid, "ztest")
    finally:
        for proc in procs.values():
            stop_group(proc.pid, 2.0, reap=proc.poll)


def test_an_environment_larger_than_the_block_keeps_the_marker_and_whole_entries() -> None:
    """`show_environment` in a process whose block is small: the fleet's marker is written
    first, then only whole entries that fit, NUL-padded (never a cut entry)."""
    code = (
        "import os, sys\n"
        "from fineslab.zygote.child import show_environment\n"
        "env = {'A_BIG': 'x' * 5000, 'B': '1', 'FINESLAB_FLEET_ID': 'mine'}\n"
        "os.environ.clear(); os.environ.update(env)\n"
        "print(show_environment(env), flush=True)\n"
        "sys.stdout.buffer.write(open('/proc/self/environ', 'rb').read())\n")
    done = subprocess.run([sys.executable, "-c", code], env={"PATH": os.environ["PATH"],
                          "PYTHONPATH": BASE_ENV["PYTHONPATH"], "SMALL": "y" * 300},
                          capture_output=True, timeout=60, check=True)
    written, block = done.stdout.split(b"\n", 1)
    assert written == b"True"
    entries = [e for e in block.split(b"\0") if e]
    assert entries[0] == f"{FLEET_MARKER}=mine".encode()
    assert b"B=1" in entries and not any(e.startswith(b"A_BIG") for e in entries), entries


def test_a_fork_runs_torch_on_its_own_thread_count_not_the_zygotes(
        lifeline: tuple[int, int], tmp_path: Path) -> None:
    """torch reads OMP_NUM_THREADS at import (the zygote's); a fork applies its own, so fleets
    of different thread counts share a zygote (`FORK_APPLIED`)."""
    z = Zygote({**BASE_ENV, "OMP_NUM_THREADS": "1"}, lifeline[0], preload=("torch",))
    z.start(timeout_s=120)
    try:
        for threads in ("2", "1"):
            out = tmp_path / f"t{threads}.json"
            proc = _fork(z, _request(out, ["exit", "0"], threads, tmp_path,
                                     OMP_NUM_THREADS=threads), tmp_path / f"t{threads}.log")
            assert proc.wait(60) == 0
            assert _report(out)["threads"] == int(threads)
    finally:
        z.stop()


def test_a_zygote_served_by_one_process_forks_for_another_on_the_others_lifeline(
        lifeline: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve_zygote`: the launchers of a process's children fork from its zygote (the test
    suite's, FINESLAB_SHARED_ZYGOTE): each fork carries its own launcher's lifeline, the
    served zygote outlives that launcher, and an environment it cannot take is refused."""
    served = serve_zygote(BASE_ENV, lifeline[0], preload=())
    other_read, other_write = os.pipe()  # the other launcher's lifeline
    try:
        monkeypatch.setenv(SHARED_ZYGOTE_VAR, str(served.socket_path))
        env = {**BASE_ENV, FLEET_MARKER: "other", "FINESLAB_T": "o"}
        zygote = shared_zygote(True, env, other_read)
        assert zygote.served and zygote.pid == served.pid
        assert shared_zygote(True, env, other_read) is zygote, "one object per launcher"
        proc = _fork(zygote, _request(tmp_path / "o.json", ["sleep"], "o", tmp_path,
                                      **{FLEET_MARKER: "other"}), tmp_path / "o.log")
        _report(tmp_path / "o.json")
        assert carries_marker(proc.pid, "other")
        zygote.stop()
        assert served.alive(), "a launcher never stops a zygote it was served"
        os.close(other_write)  # the other launcher dies
        other_write = -1
        assert proc.wait(30) != 0, "its fork dies with it"
        assert served.alive(), "the served zygote outlives it"
        assert "SGLANG_T" in str(_served_zygote(str(served.socket_path),
                                                {**env, "SGLANG_T": "1"}, other_read))
        assert "no zygote is served" in str(_served_zygote(str(tmp_path / "none.sock"), env,
                                                           other_read))
        assert served.pid is not None
        os.kill(served.pid, signal.SIGKILL)  # kill -9 of the served zygote: launchers go on
        assert served.wait_gone(10)
        assert "is gone" in str(_served_zygote(str(served.socket_path), env, other_read))
    finally:
        served.stop()
        for fd in (other_read, other_write):
            with contextlib.suppress(OSError):
                os.close(fd)
    assert not served.folder.exists()


def test_the_launchers_death_stops_its_forks_and_its_zygote(
        zygote: Zygote, lifeline: tuple[int, int], tmp_path: Path) -> None:
    proc = _fork(zygote, _request(tmp_path / "r.json", ["sleep"], "r", tmp_path),
                 tmp_path / "r.log")
    _report(tmp_path / "r.json")
    os.close(lifeline[1])  # what the kernel does when the launcher dies, however it dies
    assert proc.wait(30) != 0
    assert zygote.wait_gone(30)
    assert not tree_pids_of_group(proc.pid)
    assert not zygote.folder.exists(), "the zygote removes its folder when nobody else can"


def test_a_dead_zygote_leaves_its_forks_running_and_their_end_is_still_seen(
        zygote: Zygote, tmp_path: Path) -> None:
    proc = _fork(zygote, _request(tmp_path / "r.json", ["sleep"], "r", tmp_path),
                 tmp_path / "r.log")
    _report(tmp_path / "r.json")
    assert zygote.pid is not None
    os.kill(zygote.pid, signal.SIGKILL)
    assert zygote.wait_gone(10)
    time.sleep(0.3)
    assert proc.poll() is None, "a runtime outlives the zygote that forked it"
    assert not zygote.alive()
    stop_group(proc.pid, 2.0)
    assert proc.wait(10) == -signal.SIGKILL, "an end seen by pid alone reads as a kill"
    with pytest.raises(ZygoteUnavailable, match="not running"):
        _fork(zygote, _request(tmp_path / "s.json", ["sleep"], "s", tmp_path), tmp_path / "s")


def test_a_variable_a_module_may_read_at_import_sends_the_start_down_the_plain_path(
        zygote: Zygote, tmp_path: Path) -> None:
    request = _request(tmp_path / "r.json", ["exit", "0"], "r", tmp_path, SGLANG_T="1")
    with pytest.raises(ZygoteUnavailable, match="SGLANG_T"):
        _fork(zygote, request, tmp_path / "r.log")
    time.sleep(0.5)
    assert not (tmp_path / "r.json").exists(), "nothing was forked"


def test_a_variable_the_zygotes_own_imports_set_is_taken_with_their_value_only(
        lifeline: tuple[int, int], tmp_path: Path) -> None:
    """`import sglang` sets five cache folders in its process's environment: a launcher that
    imported it passes them on, with the values the zygote's import set too (a plain start's
    import would set them alike); another value still sends the start down the plain path."""
    (tmp_path / "sets_at_import.py").write_text(
        "import os\nos.environ.setdefault('IMPORT_SET_T', 'cache')\n")
    env = {**BASE_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), BASE_ENV["PYTHONPATH"]])}
    z = Zygote(env, lifeline[0], preload=("sets_at_import",))
    z.start(timeout_s=60)
    try:
        assert z.imported == {"IMPORT_SET_T": "cache"}
        ok = _request(tmp_path / "ok.json", ["exit", "0"], "ok", tmp_path,
                      PYTHONPATH=env["PYTHONPATH"], IMPORT_SET_T="cache")
        assert _fork(z, ok, tmp_path / "ok.log").wait(30) == 0
        other = dataclasses.replace(ok, env={**ok.env, "IMPORT_SET_T": "elsewhere"})
        with pytest.raises(ZygoteUnavailable, match="IMPORT_SET_T"):
            _fork(z, other, tmp_path / "other.log")
    finally:
        z.stop()


def test_a_host_processs_variables_are_applied_unless_the_zygote_imported_their_package(
        lifeline: tuple[int, int], tmp_path: Path) -> None:
    """A launcher in a Ray worker (or a Jupyter kernel) has its host's variables, which the
    packages that read them read, not SGLang: a fork from a zygote that did not import `ray`
    gets them (and a kernel's TERM) as a plain start would; one that imported `ray` refuses.
    The zygote's own SPT_NOENV=1, which a Ray worker has too, is no difference."""
    env = {k: v for k, v in BASE_ENV.items() if not k.startswith("RAY_")}
    host = {"RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "4242", "TERM": "xterm-color"}
    plain = Zygote(env, lifeline[0], preload=())
    plain.start(timeout_s=60)
    try:
        assert plain.modules is not None and "ray" not in plain.modules
        request = _request(tmp_path / "r.json", ["exit", "0"], "r", tmp_path, **host,
                           SPT_NOENV="1")  # a Ray worker's, as the zygote runs with it
        assert _fork(plain, request, tmp_path / "r.log").wait(30) == 0
        assert _report(tmp_path / "r.json")["host"] == host
    finally:
        plain.stop()
    (tmp_path / "ray.py").write_text("import os\n")  # a `ray` the zygote imports
    with_ray = Zygote({**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])},
                      lifeline[0], preload=("ray",))
    with_ray.start(timeout_s=60)
    try:
        assert with_ray.modules is not None and "ray" in with_ray.modules
        request = _request(tmp_path / "s.json", ["exit", "0"], "s", tmp_path, **host,
                           PYTHONPATH=with_ray.env["PYTHONPATH"])
        with pytest.raises(ZygoteUnavailable, match="RAY_JOB_ID, RAY_RAYLET_PID"):
            _fork(with_ray, request, tmp_path / "s.log")
    finally:
        with_ray.stop()


def test_a_malformed_request_is_refused_and_the_zygote_serves_on(
        zygote: Zygote, tmp_path: Path) -> None:
    for frame in (b"\xff\xff\xff\xff", struct.pack("!I", 5) + b"[1,2]", b"\x00\x00"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(zygote.socket_path))
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1024)
    assert zygote.alive()
    proc = _fork(zygote, _request(tmp_path / "r.json", ["exit", "3"], "r", tmp_path),
                 tmp_path / "r.log")
    assert proc.wait(30) == 3


def test_a_zygote_whose_imports_initialise_cuda_refuses_to_serve(
        lifeline: tuple[int, int], tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_initialized():\n        return True\n")
    env = {**BASE_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"),
                                                       BASE_ENV["PYTHONPATH"]])}
    z = Zygote(env, lifeline[0], preload=("torch",))
    with pytest.raises(ZygoteUnavailable, match="CUDA"):
        z.start(timeout_s=60)
    assert not z.alive()
    assert not z.folder.exists(), "a zygote that did not start leaves no folder"


def test_the_zygote_leaves_its_starters_process_tree(zygote: Zygote) -> None:
    """Regression: SGLang's in-process `Engine.shutdown()` kills every descendant of its
    process; a test run's 22 engines killed the test process's zygote until it was given up
    and every later start was plain."""
    assert zygote.alive() and zygote.pid is not None
    assert zygote.pid not in descendant_pids(os.getpid())


def test_a_zygote_abandoned_while_it_imports_stops_at_once_and_leaves_nothing(
        lifeline: tuple[int, int], tmp_path: Path) -> None:
    """A launch that fails while its zygote still imports (a bad checkpoint) must not wait for
    the import: `abandon` kills the starting zygote and its `start` raises ZygoteAbandoned."""
    import threading

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "slow_import.py").write_text("import time\ntime.sleep(120)\n")
    env = {**BASE_ENV, "PYTHONPATH": os.pathsep.join([str(slow), BASE_ENV["PYTHONPATH"]])}
    z = Zygote(env, lifeline[0], preload=("slow_import",))
    raised: list[BaseException] = []

    def start() -> None:
        try:
            z.start(timeout_s=120)
        except BaseException as exc:  # the test reads what it raised
            raised.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 30
    while getattr(z, "_starter", None) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    starter = z._starter
    assert starter is not None, "the zygote's starter never ran"
    z.abandon()
    thread.join(20)
    assert not thread.is_alive(), "start() still waits for the import"
    assert len(raised) == 1 and isinstance(raised[0], ZygoteAbandoned), raised
    assert not z.folder.exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(starter, 0)

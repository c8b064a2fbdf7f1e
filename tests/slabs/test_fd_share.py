"""The arena's descriptor server (fd_share.py), on CPU with memfds: a runtime process gets
duplicates of every descriptor, in order, over more than one batch; a dead server is a clear
error; closing removes the socket."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from fineslab.errors import EnvironmentSetupError
from fineslab.slabs.fd_share import BATCH, FdServer, fetch_fds

_CTX = mp.get_context("spawn")


def _memfds(count: int) -> list[int]:
    fds = []
    for i in range(count):
        fd = os.memfd_create(f"slab{i}")
        os.write(fd, i.to_bytes(4, "little"))
        fds.append(fd)
    return fds


def _reader(path: str, queue: mp.Queue) -> None:
    fds = fetch_fds(Path(path))
    queue.put([int.from_bytes(os.pread(fd, 4, 0), "little") for fd in fds])
    for fd in fds:
        os.close(fd)


def test_a_runtime_process_gets_every_descriptor_in_order(tmp_path: Path) -> None:
    fds = _memfds(BATCH + 37)  # two batches
    server = FdServer(tmp_path / "arena.fds", fds)
    try:
        assert (tmp_path / "arena.fds").stat().st_mode & 0o777 == 0o600
        queue: mp.Queue = _CTX.Queue()
        child = _CTX.Process(target=_reader, args=(str(tmp_path / "arena.fds"), queue))
        child.start()
        got = queue.get(timeout=60)
        child.join(30)
        assert child.exitcode == 0
        assert got == list(range(len(fds))), "each slab's descriptor, in the server's order"
    finally:
        server.close()
        for fd in fds:
            os.close(fd)
    assert not (tmp_path / "arena.fds").exists(), "closing removes the socket"


def test_a_gone_server_is_a_clear_error(tmp_path: Path) -> None:
    fds = _memfds(1)
    server = FdServer(tmp_path / "arena.fds", fds)
    server.close()
    os.close(fds[0])
    with pytest.raises(EnvironmentSetupError, match="not served"):
        fetch_fds(tmp_path / "arena.fds")

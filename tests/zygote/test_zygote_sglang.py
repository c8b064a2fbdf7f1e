"""Warm starts of real SGLang runtimes: two models with different settings forked from one
zygote, each seeing only its own; output identical to a plain start's; a warm start that dies
during start-up started again plainly; a killed zygote replaced while its runtimes serve on."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fineslab.errors import EnvironmentSetupError
from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin import ArenaJoin
from fineslab.slabs import ArenaSpec, KVDtype, KVShape, SlabArena, snapshot
from fineslab.slabs.sizing import fit_format

# The launcher's own zygote, as a user's fleet has (not the suite's: conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_zygote")]

SLAB = 1 << 20
PROMPT = [11, 250, 37, 999, 4, 512, 77, 1200, 31, 8]


def _arena() -> SlabArena:
    fmt = fit_format(KVShape("a", 4, 2, 64, KVDtype.from_name("bfloat16")), SLAB, [16])
    assert fmt is not None
    fleet_id = f"z{uuid.uuid4().hex[:10]}"
    return SlabArena.create(ArenaSpec(fleet_id, "cpu:0", 16 * SLAB, SLAB,
                                      fmt.blocks_per_slab(SLAB)))


def _greedy(server: ServerProcess) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    reply = httpx.post(server.spec.base_url + "/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["output_ids"])


def _info(server: ServerProcess) -> dict[str, object]:
    return dict(httpx.get(server.spec.base_url + "/server_info", timeout=30).json())


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def two(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[ServerProcess, ServerProcess, SlabArena]]:
    logs = tmp_path_factory.mktemp("zygote")
    arena = _arena()
    a = ServerProcess(ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--page-size", "16", "--log-level", "warning"),
        env=ArenaJoin(arena.spec.fleet_id, "a").environ()), logs / "a.log")
    b = ServerProcess(ServerSpec(str(model_cache / "qwen2-tiny"), free_port(), extra_args=(
        "--page-size", "32", "--max-total-tokens", "1024", "--log-level", "warning")),
        logs / "b.log")
    try:
        a.wait_healthy(300)
        b.wait_healthy(300)
        yield a, b, arena
    finally:
        a.stop()
        b.stop()
        arena.close()


def test_two_runtimes_from_one_zygote_each_see_only_their_own_model_settings_and_arena(
        two: tuple[ServerProcess, ServerProcess, SlabArena]) -> None:
    a, b, arena = two
    assert (a.start_kind, b.start_kind) == ("warm", "warm")
    assert a.zygote is not None and a.zygote is b.zygote and a.zygote.pid is not None
    assert _parent(a.proc.pid) == _parent(b.proc.pid) == a.zygote.pid, \
        "both wrappers are forks of the one zygote"
    info_a, info_b = _info(a), _info(b)
    assert str(info_a["model_path"]).endswith("llama-tiny")
    assert str(info_b["model_path"]).endswith("qwen2-tiny")
    assert (info_a["page_size"], info_b["page_size"]) == (16, 32)
    assert info_b["max_total_tokens"] == 1024
    _greedy(a)
    _greedy(b)
    owners = {o.runtime_id for o in snapshot(arena.table).owners if o.alive}
    assert owners == {"a"}, ("only the runtime told to join the arena joined it: its "
                             f"environment was read after the fork ({owners})")


def test_a_warm_start_answers_as_a_plain_start_of_the_same_runtime(
        two: tuple[ServerProcess, ServerProcess, SlabArena], tmp_path: Path) -> None:
    _, b, _ = two
    plain = ServerProcess(b.spec.__class__(b.spec.model_path, free_port(),
                                           extra_args=b.spec.extra_args),
                          tmp_path / "plain.log", warm=False)
    try:
        plain.wait_healthy(300)
        assert plain.start_kind == "plain" and plain.zygote is None
        assert _greedy(plain) == _greedy(b), "greedy output identical to a plain start's"
        # Signal dispositions as a fresh interpreter's: with SIGPIPE at its default, a warm
        # server died without a word the first time it wrote to a connection its client had
        # closed (the engine benchmark's dropped streams).
        assert _signals(b) == _signals(plain)
        assert _signals(b)["ignored"] & (1 << (signal.SIGPIPE - 1))
    finally:
        plain.stop()


def _signals(server: ServerProcess) -> dict[str, int]:
    """The server process's ignored and caught signal masks (/proc/PID/status)."""
    pid = next(p for p in server.tree_pids()
               if b"sglang.launch_server" in Path(f"/proc/{p}/cmdline").read_bytes()
               and b"fineslab.lifeline" not in Path(f"/proc/{p}/cmdline").read_bytes())
    status = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return {"ignored": int(status["SigIgn"], 16), "caught": int(status["SigCgt"], 16)}


def test_a_warm_start_that_dies_during_start_up_is_started_again_plainly(
        model_cache: Path, tmp_path: Path) -> None:
    server = ServerProcess(ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--max-total-tokens", "1024", "--log-level", "warning")), tmp_path / "s.log")
    try:
        assert server.start_kind == "warm"
        os.killpg(server.proc.pid, signal.SIGKILL)  # a crash before it was healthy
        server.wait_healthy(300)
        assert server.start_kind == "plain-after-warm"
        assert len(_greedy(server)) == 8
    finally:
        server.stop()
    assert not server.tree_pids()


def test_a_killed_zygote_is_replaced_and_its_runtimes_serve_on(
        two: tuple[ServerProcess, ServerProcess, SlabArena], model_cache: Path,
        tmp_path: Path) -> None:
    a, _, _ = two
    assert a.zygote is not None and a.zygote.pid is not None
    os.kill(a.zygote.pid, signal.SIGKILL)
    assert a.zygote.wait_gone(10)
    assert len(_greedy(a)) == 8, "a runtime serves on without its zygote"
    assert a.proc.poll() is None
    fresh = ServerProcess(ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--max-total-tokens", "1024", "--log-level", "warning")), tmp_path / "f.log")
    try:
        fresh.wait_healthy(300)
        assert fresh.start_kind == "warm"
        assert fresh.zygote is not None and fresh.zygote is not a.zygote
        assert len(_greedy(fresh)) == 8
    finally:
        fresh.stop()


def test_a_server_stopped_during_its_warm_start_is_not_started_again_plainly(
        model_cache: Path, tmp_path: Path) -> None:
    """Regression: a supervisor's stop while a restart waited made the warm start's fallback
    open a plain start on the closed log (ValueError in the restart thread)."""
    server = ServerProcess(ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--max-total-tokens", "1024", "--log-level", "warning")), tmp_path / "s.log")
    assert server.start_kind == "warm"
    server.stop(grace_s=1)
    with pytest.raises(EnvironmentSetupError, match="stopped during start-up"):
        server.wait_healthy(60)
    assert server.start_kind == "warm", "no plain start after a stop"
    assert not server.tree_pids()

"""Ports of runtimes: where `free_port` draws them, and a runtime whose port was taken during its
start-up (a real SGLang server on CPU) being started again on a fresh port by the supervisor.

The same servers check how a stop ends: without SGLang's crash diagnostics (a 5 s sleep, then
py-spy) by default, with them when the spec's env asks (the negative control)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from fineslab.fleet.config import DeviceConfig, ModelConfig, SupervisionPolicy
from fineslab.fleet.plan import RuntimePlan
from fineslab.fleet.supervisor import SupervisedRuntime, Supervisor
from fineslab.runtime import PORT_BAND, ServerSpec, free_port, start_server


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_free_ports_come_from_the_band_below_the_ephemeral_range_and_never_twice() -> None:
    ports = [free_port() for _ in range(200)]
    high = min(PORT_BAND[1], _ephemeral_low() - 1)
    assert all(PORT_BAND[0] <= p <= high for p in ports), ports
    assert len(set(ports)) == len(ports), "one process is never handed the same port twice"


def test_free_port_skips_a_port_someone_holds() -> None:
    held = []
    try:
        for _ in range(20):  # hold 20 ports of the band, then ask for more
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        fresh = [free_port() for _ in range(20)]
        assert not taken & set(fresh)
        for port in fresh:  # each really is bindable
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("127.0.0.1", port))
    finally:
        for sock in held:
            sock.close()


def _plan(runtime_id: str) -> RuntimePlan:
    model = ModelConfig(name="llama-tiny", preset="llama-tiny", ttft_slo_s=5.0,
                        request_rate_per_s=1.0, replicas=1)
    return RuntimePlan(runtime_id, model, "", 0,
                       DeviceConfig(name="cpu", kind="cpu", memory_gib=1), None)


@pytest.fixture
def squatted(model_cache: Path) -> Iterator[ServerSpec]:
    """A llama-tiny server spec whose port another socket holds (listening) for the test."""
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", free_port()))
    squatter.listen()
    yield ServerSpec(str(model_cache / "llama-tiny"), squatter.getsockname()[1],
                     extra_args=("--max-total-tokens", "2048"))
    squatter.close()


def _supervised(spec: ServerSpec, log_path: Path, progress: Callable[[str], None]
                ) -> tuple[SupervisedRuntime, Supervisor]:
    """One runtime under a Supervisor with no router and no arena behind it."""
    runtime = SupervisedRuntime(_plan("llama-r0"), spec, log_path)
    return runtime, Supervisor([runtime], on_down=lambda _id, _why, _eta: None,
                               on_up=lambda _id, _pid, _url: None, reclaim=lambda _d: [],
                               progress=progress, policy=SupervisionPolicy(health_timeout_s=300))


DIAGNOSTICS = "Sleeping 5 seconds before crash diagnostics"


@pytest.mark.slow
def test_a_runtime_whose_port_is_taken_at_start_up_comes_up_on_a_fresh_port(
        squatted: ServerSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The stop waits as long as start_server's does, so that the negative control below is not
    # a race: with the fleet's 1 s grace, a loaded machine SIGKILLs the tree before SGLang has
    # logged that it sleeps for its diagnostics (CI, 2026-11-30).
    monkeypatch.setattr("fineslab.fleet.supervisor.STOP_GRACE_S", 15.0)
    taken = squatted.port
    messages: list[str] = []
    asked = dataclasses.replace(squatted, env={"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})
    runtime, supervisor = _supervised(asked, tmp_path / "llama-r0.log", messages.append)
    try:
        supervisor.start_all()
        assert runtime.spec.port != taken
        assert f"port {taken} was taken during start-up" in "\n".join(messages), messages
        assert "address already in use" in (tmp_path / "llama-r0.log").read_text().lower(), \
            "the first start must have failed on the taken port (else this tests nothing)"
        reply = httpx.post(runtime.spec.base_url + "/generate", timeout=60, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert reply.status_code == 200, reply.text
        assert runtime.restarts == 0, "a port retry is not a restart"
    finally:
        supervisor.stop_all()
    assert runtime.process is not None and not runtime.process.tree_pids()
    logs = "".join(log.read_text() for log in tmp_path.glob("llama-r0*.log"))
    assert DIAGNOSTICS in logs, "negative control: diagnostics asked for in the model's env run"


@pytest.mark.slow
def test_a_port_still_taken_after_the_last_retry_fails_the_start_with_the_log_named(
        squatted: ServerSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fineslab.fleet.supervisor.PORT_RETRIES", 0)  # no retry left
    _, supervisor = _supervised(squatted, tmp_path / "llama-r0.log", lambda _m: None)
    try:
        with pytest.raises(Exception, match="runtime llama-r0 did not start") as info:
            supervisor.start_all()
        assert str(tmp_path / "llama-r0.log") in str(info.value)
        assert "address already in use" in str(info.value).lower()
    finally:
        supervisor.stop_all()


@pytest.mark.slow
def test_start_server_moves_to_a_fresh_port_when_its_port_is_taken(
        squatted: ServerSpec, tmp_path: Path) -> None:
    with start_server(squatted, tmp_path / "sglang.log", timeout_s=300) as server:
        assert server.spec.port != squatted.port
        health = httpx.get(server.spec.base_url + "/health", timeout=30)
        assert health.status_code == 200
    assert not server.tree_pids()
    log = (tmp_path / "sglang.log").read_text()
    assert "SIGTERM received" in log, "the stop reached SGLang as a signal"
    assert DIAGNOSTICS not in log, "a stop must not wait out SGLang's crash diagnostics"

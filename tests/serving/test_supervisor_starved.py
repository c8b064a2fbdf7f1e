"""A runtime that neither answers its probes nor computes, while its arena has no slab free, is
starved, not hung (issue #35, finding 6): on a machine loaded by other work the chaos benchmark
had qwen2 killed as hung ("used 0.23 s of CPU meanwhile") while its probe's one token waited
for KV that a restarting neighbour held. It is restarted only after `STARVED_MAX_S`.

The supervisor's own probe loop, with a stand-in process (no SGLang): its probes fail, its CPU
does not move, and the fleet's `starved` hook says whether the arena is full.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from fineslab.fleet import supervisor as supervisor_module
from fineslab.fleet.config import SupervisionPolicy
from fineslab.fleet.supervisor import Supervisor

POLICY = SupervisionPolicy(probe_interval_s=0.01, probe_timeout_s=0.01, probe_failures=2)


class SilentProcess:
    """Answers no probe, uses no CPU, is not stopped."""

    spec = SimpleNamespace(base_url="http://127.0.0.1:9")

    def cpu_ticks(self) -> dict[int, int]:
        return {1: 100}

    def stopped(self) -> bool:
        return False


def _run(monkeypatch: pytest.MonkeyPatch, starved: str | None, max_s: float,
         run_s: float) -> tuple[list[str], int]:
    monkeypatch.setattr(supervisor_module, "STARVED_MAX_S", max_s)
    downs: list[str] = []
    asked = [0]

    def starved_hook(_plan: object) -> str | None:
        asked[0] += 1
        return starved

    runtime = SimpleNamespace(plan=SimpleNamespace(runtime_id="r0"), process=SilentProcess(),
                              restarting=False)
    supervisor = Supervisor([], on_down=lambda *a: None, on_up=lambda *a: None,
                            reclaim=lambda _d: [], progress=lambda _m: None, policy=POLICY,
                            starved=starved_hook)
    supervisor._probe = lambda _url: False  # type: ignore[method-assign]
    supervisor._down = lambda r, reason: (downs.append(reason),  # type: ignore[method-assign]
                                          supervisor._stopping.set())
    loop = threading.Thread(target=supervisor._probe_loop, args=(runtime,), daemon=True)
    loop.start()
    time.sleep(run_s)
    supervisor._stopping.set()
    loop.join(5)
    return downs, asked[0]


def test_a_silent_idle_runtime_that_waits_for_memory_is_not_killed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    downs, asked = _run(monkeypatch, "0 free slabs on cpu, held by llama-r0 (40)", 60.0, 0.5)
    assert downs == [] and asked >= 2, "starved: probes fail, nothing is restarted"


def test_a_starved_runtime_is_restarted_after_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    downs, _ = _run(monkeypatch, "0 free slabs on cpu", 0.1, 2.0)
    assert len(downs) == 1 and "waited for memory for 0 s" in downs[0], downs


def test_negative_control_with_room_a_silent_idle_runtime_is_hung(
        monkeypatch: pytest.MonkeyPatch) -> None:
    downs, _ = _run(monkeypatch, None, 60.0, 2.0)
    assert len(downs) == 1 and downs[0].startswith("hung:") and "memory" not in downs[0], downs

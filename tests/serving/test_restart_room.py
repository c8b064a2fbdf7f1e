"""A restart whose weights find no room waits for it, bounded, saying why (issue #35, finding 4).

A streaming lender killed while lending came back into an arena whose free slabs a busy
neighbour's cache held: SGLang flushes only an idle runtime, so the restart failed at once, three
times in a row (an 85 s outage), each failure leaving files behind. `Fleet._wait_for_room` now
waits, flushing each neighbour's cache as it goes idle, and starts once the weights fit, or at
`ROOM_WAIT_S`. Here without processes: the arena's free slabs and the neighbours' flushes are
stand-ins, the waiting is the fleet's own code.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from fineslab.fleet import machine as fleet_module
from fineslab.fleet.machine import Fleet


class BusyNeighbour:
    """A neighbour whose cache holds `slabs` slabs and who goes idle after `busy_rounds`
    flush attempts (before that SGLang refuses its flush)."""

    def __init__(self, slabs: int, busy_rounds: int) -> None:
        self.slabs, self.busy_rounds, self.attempts = slabs, busy_rounds, 0

    def flush_idle(self, device: str, exclude: str = "") -> list[str]:
        self.attempts += 1
        if self.attempts <= self.busy_rounds or not self.slabs:
            return []
        self.slabs = 0
        return ["neighbour-r0"]


def _fleet(neighbour: BusyNeighbour, free: int, lines: list[str]) -> SimpleNamespace:
    owner = SimpleNamespace(runtime_id="neighbour-r0", alive=True, num_slabs=neighbour.slabs)
    return SimpleNamespace(
        reclaimer=neighbour, _stopping=threading.Event(), progress=lines.append,
        _free_weight_slabs=lambda device: free + (0 if neighbour.slabs else 11),
        slab_snapshots=lambda: {"cpu": SimpleNamespace(owners=[owner])})


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "ROOM_POLL_S", 0.01)


def _plan() -> SimpleNamespace:
    return SimpleNamespace(runtime_id="lender-r0", device=SimpleNamespace(name="cpu"))


def _wait(fake: SimpleNamespace, need: int) -> None:
    fake._slab_holders = lambda device: Fleet._slab_holders(fake, device)  # type: ignore
    Fleet._wait_for_room(fake, _plan(), need)  # type: ignore[arg-type]


def test_a_restart_waits_for_a_busy_neighbour_to_go_idle_and_says_what_it_took() -> None:
    neighbour, lines = BusyNeighbour(slabs=11, busy_rounds=5), []
    fake = _fleet(neighbour, free=0, lines=lines)
    _wait(fake, need=11)
    assert neighbour.attempts == 6, "it tried each round until the neighbour went idle"
    assert "waits up to 120 s for 11 free slabs" in lines[0], lines
    assert "0 free, the rest held by neighbour-r0 (11)" in lines[0], lines
    assert "room for lender-r0's weights" in lines[-1], lines
    assert "flushed the caches of neighbour-r0" in lines[-1], lines


def test_a_restart_with_room_does_not_wait() -> None:
    neighbour, lines = BusyNeighbour(slabs=0, busy_rounds=0), []
    _wait(_fleet(neighbour, free=11, lines=lines), need=11)
    assert neighbour.attempts == 0 and lines == []


def test_the_wait_is_bounded_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fleet_module, "ROOM_WAIT_S", 0.2)
    neighbour, lines = BusyNeighbour(slabs=11, busy_rounds=10**9), []
    with caplog.at_level(logging.WARNING, logger="fineslab.fleet.machine"):
        _wait(_fleet(neighbour, free=3, lines=lines), need=11)
    assert "starts without room for its weights" in caplog.text, caplog.text
    assert "3 of 11 slabs free, held by neighbour-r0 (11)" in caplog.text, caplog.text


def test_a_stopping_fleet_does_not_wait() -> None:
    neighbour, lines = BusyNeighbour(slabs=11, busy_rounds=10**9), []
    fake = _fleet(neighbour, free=0, lines=lines)
    fake._stopping.set()
    _wait(fake, need=11)
    assert neighbour.attempts == 0


def test_a_slow_start_says_why_and_empties_idle_caches_when_the_arena_is_full() -> None:
    # Issue #35, finding 3: a five-model elastic fleet waited 9 minutes for a runtime whose
    # warm-up found 0 free slabs, and never said why.
    neighbour, lines = BusyNeighbour(slabs=11, busy_rounds=0), []
    fake = _fleet(neighbour, free=0, lines=lines)
    fake._slab_holders = lambda device: Fleet._slab_holders(fake, device)  # type: ignore
    Fleet._slow_start(fake, _plan(), 30.0)  # type: ignore[arg-type]
    assert lines == ["runtime lender-r0 is still starting after 30 s (0 free slabs on cpu, "
                     "held by neighbour-r0 (11)); flushed the prefix caches of neighbour-r0"]


def test_a_slow_start_with_room_is_only_reported() -> None:
    neighbour, lines = BusyNeighbour(slabs=11, busy_rounds=0), []
    Fleet._slow_start(_fleet(neighbour, free=20, lines=lines), _plan(), 60.0)  # type: ignore
    assert lines == ["runtime lender-r0 is still starting after 60 s (20 free slabs on cpu)"]
    assert neighbour.attempts == 0


def test_a_full_arena_makes_a_silent_runtime_starved_and_empties_idle_caches() -> None:
    neighbour, lines = BusyNeighbour(slabs=11, busy_rounds=0), []
    fake = _fleet(neighbour, free=0, lines=lines)
    fake._slab_holders = lambda device: Fleet._slab_holders(fake, device)  # type: ignore
    why = Fleet._starved(fake, _plan())  # type: ignore[arg-type]
    assert why == ("0 free slabs on cpu, held by neighbour-r0 (11); flushed the prefix caches "
                   "of neighbour-r0"), why
    roomy = _fleet(BusyNeighbour(slabs=0, busy_rounds=0), free=20, lines=[])
    assert Fleet._starved(roomy, _plan()) is None  # type: ignore[arg-type]

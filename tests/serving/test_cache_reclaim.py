"""The launcher's cache reclaimer (fineslab.fleet.reclaim), round by round.

Found by the long fuzz run against the demo fleet (issue #15): the prefix caches of idle models
kept nearly the whole arena and a neighbour's request waited for ever. The rule: when a runtime
with work is pressed (few free slabs, or its block count stalled), the idle runtimes on its
device that hold blocks flush their caches, each at most once per MIN_GAP_S. Snapshots and
demand are given; the flush goes over real HTTP to a small server that records it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fineslab.scheduler.reclaim import ReclaimConfig

from fineslab.fleet.reclaim import CacheReclaimer
from fineslab.slabs.integrity import OwnerUsage, TableSnapshot

NUM_SLABS = 56


@pytest.fixture
def runtimes() -> Iterator[tuple[dict[str, str], list[str]]]:
    """Three fake runtimes answering POST /flush_cache 200 (the calls are recorded)."""
    calls: list[str] = []
    servers, urls = [], {}
    for name in ("busy", "idle", "idle2"):
        class Handler(BaseHTTPRequestHandler):
            runtime = name

            def do_POST(self) -> None:
                calls.append(f"{self.runtime} {self.path}")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls[name] = f"http://127.0.0.1:{server.server_port}"
    yield urls, calls
    for server in servers:
        server.shutdown()


def _snap(free_slabs: int, used: dict[str, int]) -> TableSnapshot:
    owners = tuple(OwnerUsage(name, 1, True, 4096, max(1, blocks // 8), blocks, 0)
                   for name, blocks in used.items())
    return TableSnapshot(1 << 20, NUM_SLABS, {(0, "FREE"): free_slabs}, owners)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


CONFIG = ReclaimConfig()


def _reclaimer(urls: dict[str, str], snap: list[TableSnapshot], demand: dict[str, int],
               clock: Clock) -> CacheReclaimer:
    return CacheReclaimer({"cpu": ["busy", "idle", "idle2"]}, lambda _: snap[0],
                          lambda: demand, urls.__getitem__, clock)


def test_few_free_slabs_flush_every_idle_holder_once_per_gap(runtimes: tuple) -> None:
    urls, calls = runtimes
    clock, demand = Clock(), {"busy": 1, "idle": 0, "idle2": 0}
    snap = [_snap(2, {"busy": 40, "idle": 300, "idle2": 0})]
    reclaimer = _reclaimer(urls, snap, demand, clock)
    assert reclaimer.run_once() == ["idle"], "idle2 holds no blocks: nothing to flush"
    assert calls == ["idle /flush_cache"]
    clock.now_s += 1
    assert reclaimer.run_once() == [], "at most once per MIN_GAP_S"
    clock.now_s += CONFIG.min_gap_s
    assert reclaimer.run_once() == ["idle"]


def test_a_stalled_runtime_is_helped_although_free_slabs_are_not_low(runtimes: tuple) -> None:
    # Free slabs are not few (20 of 56), but a request needing more than they give waits: its
    # runtime's block count does not move.
    urls, _ = runtimes
    clock, demand = Clock(), {"busy": 1, "idle": 0, "idle2": 0}
    snap = [_snap(20, {"busy": 40, "idle": 300, "idle2": 8})]
    reclaimer = _reclaimer(urls, snap, demand, clock)
    assert reclaimer.run_once() == [], "20 free slabs and no stall yet"
    assert reclaimer.stalled == {"cpu": False}
    clock.now_s += CONFIG.stall_s
    assert reclaimer.run_once() == ["idle", "idle2"]
    assert reclaimer.stalled == {"cpu": True}, "the layer lender reads it"
    # Progress (the block count moves) is not a stall.
    snap[0] = _snap(20, {"busy": 41, "idle": 0, "idle2": 0})
    clock.now_s += CONFIG.min_gap_s + CONFIG.stall_s
    assert reclaimer.run_once() == []
    assert reclaimer.stalled == {"cpu": False}


def test_a_stall_with_most_of_the_arena_free_presses_nobody(runtimes: tuple) -> None:
    # Issue #35: while a runtime was SIGSTOPped (its requests in flight, its blocks still)
    # the idle neighbours were flushed every ~6 s with 55 of 56 slabs free.
    urls, calls = runtimes
    clock, demand = Clock(), {"busy": 1, "idle": 0, "idle2": 0}
    snap = [_snap(55, {"busy": 8, "idle": 8, "idle2": 0})]
    reclaimer = _reclaimer(urls, snap, demand, clock)
    for _ in range(3):
        assert reclaimer.run_once() == []
        clock.now_s += CONFIG.stall_s + CONFIG.min_gap_s
    assert reclaimer.stalled == {"cpu": True} and reclaimer.pressed == {"cpu": False}
    assert calls == []


def test_nothing_is_flushed_without_work_or_from_a_busy_runtime(runtimes: tuple) -> None:
    urls, calls = runtimes
    clock = Clock()
    snap = [_snap(0, {"busy": 40, "idle": 300, "idle2": 8})]
    reclaimer = _reclaimer(urls, snap, {"busy": 0, "idle": 0, "idle2": 0}, clock)
    assert reclaimer.run_once() == [], "a full arena with no work waiting needs nothing"
    reclaimer = _reclaimer(urls, snap, {"busy": 2, "idle": 1, "idle2": 0}, clock)
    assert reclaimer.run_once() == ["idle2"], "a runtime with requests keeps its cache"
    assert calls == ["idle2 /flush_cache"]


def test_a_restart_flushes_every_idle_holder_at_once_but_itself(runtimes: tuple) -> None:
    # A streaming fleet's lender, restarted after a SIGSTOP, found 8 free slabs for its 11: an
    # idle neighbour's cache held them, and no round flushed it (a runtime starting up has no
    # requests, so nothing is pressed). The restart now asks for the flush itself.
    urls, calls = runtimes
    clock, demand = Clock(), {"busy": 1, "idle": 0, "idle2": 0}
    snap = [_snap(20, {"busy": 40, "idle": 300, "idle2": 8})]
    reclaimer = _reclaimer(urls, snap, demand, clock)
    assert reclaimer.flush_idle("cpu", exclude="idle2") == ["idle"], (
        "busy has work and idle2 is the one restarting")
    assert reclaimer.flush_idle("cpu") == ["idle", "idle2"], "no gap applies to a restart"
    assert calls == ["idle /flush_cache", "idle /flush_cache", "idle2 /flush_cache"]
    assert reclaimer.flush_idle("gpu") == [], "a device with no runtimes"
    snap[0] = _snap(2, {"busy": 40, "idle": 300, "idle2": 8})  # pressed: few free slabs
    assert reclaimer.run_once() == [], "the round's gap counts from the restart's flush"
    clock.now_s += CONFIG.min_gap_s
    assert reclaimer.run_once() == ["idle", "idle2"], "and ends like any other"

"""The elastic manager's decisions (fineslab.router.elastic) without runtimes: which model sleeps
to make room, in which order, and what a request or `ctl` gets when nothing can.

The runtime control calls are recorded instead of sent (the real calls, against real SGLang
runtimes, are in test_elastic_fleet.py); the arena is a count of free slabs that each sleep
raises by the sleeper's weight slabs, as the slab table does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from fineslab.router import elastic
from fineslab.router.elastic import ArenaView, CannotWake, Elastic, ElasticSpec, NotElastic


@dataclass
class FakeReplica:
    runtime_id: str
    up: bool = True
    inflight: int = 0


@dataclass
class FakeMetrics:
    events: list[tuple[str, str]] = field(default_factory=list)

    def observe_sleep(self, model: str, seconds: float) -> None:
        self.events.append((model, "sleep"))

    def observe_wake(self, model: str, seconds: float) -> None:
        self.events.append((model, "wake"))

    def evicted(self, model: str) -> None:
        self.events.append((model, "eviction"))


@dataclass
class FakeRouter:
    replicas: dict[str, list[FakeReplica]]
    queues: dict[str, list[object]] = field(default_factory=dict)
    metrics: FakeMetrics = field(default_factory=FakeMetrics)


class Arena:
    """Free slabs of one device; weight slabs per runtime (taken on wake, freed on sleep)."""

    def __init__(self, free: int, weights: dict[str, int]) -> None:
        self.free, self.weights = free, dict(weights)
        self.held = dict(weights)
        self.asleep: set[str] = set()
        self.call_s = 0.0  # how long each control call takes

    def view(self) -> ArenaView:
        return ArenaView(lambda device: self.free, lambda rid: self.held.get(rid, 0),
                         self.note)

    def note(self, runtime_id: str, asleep: bool) -> None:
        (self.asleep.add if asleep else self.asleep.discard)(runtime_id)


@pytest.fixture
def calls() -> list[tuple[str, str]]:
    return []


def _setup(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]], arena: Arena,
           specs: list[ElasticSpec], clock: list[float]) -> tuple[Elastic, FakeRouter]:
    async def fake_call(replica: FakeReplica, path: str, body: dict[str, object]) -> None:
        calls.append((replica.runtime_id, path))
        await asyncio.sleep(arena.call_s)
        if path == "/release_memory_occupation":
            arena.free += arena.held.pop(replica.runtime_id)
        elif path == "/resume_memory_occupation":
            need = arena.weights[replica.runtime_id]
            assert arena.free >= need, "a wake was asked without room (the runtime would stop)"
            arena.free -= need
            arena.held[replica.runtime_id] = need

    monkeypatch.setattr(elastic, "_call", fake_call)
    monkeypatch.setattr(elastic, "ROOM_WAIT_S", 0.3)
    monkeypatch.setattr(elastic, "ROOM_POLL_S", 0.05)
    router = FakeRouter({s.name: [FakeReplica(s.runtime_id)] for s in specs})
    manager = Elastic(specs, arena.view(), retry_after_s=7, clock=lambda: clock[0])
    manager.router = router  # type: ignore[assignment]
    manager.models = {s.name: elastic.ElasticModel(s, last_used_s=0.0) for s in specs}
    return manager, router


def _spec(name: str, pinned: bool = False) -> ElasticSpec:
    return ElasticSpec(name, f"{name}-r0", "cpu", None if pinned else 60.0, pinned)


def test_a_wake_puts_the_least_recently_used_idle_models_to_sleep_until_it_fits(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    arena = Arena(free=1, weights={"a-r0": 4, "b-r0": 2, "c-r0": 2, "p-r0": 3})
    clock = [100.0]
    manager, _ = _setup(monkeypatch, calls, arena,
                        [_spec("a"), _spec("b"), _spec("c"), _spec("p", pinned=True)], clock)
    models = manager.models
    models["p"].last_used_s = 1.0   # least recently used, but pinned
    models["c"].last_used_s = 10.0  # then c, then b
    models["b"].last_used_s = 20.0

    async def run() -> None:
        await manager.sleep("a")
        arena.free = 1  # the arena filled up meanwhile (another model's KV)
        await manager.wake("a")

    asyncio.run(run())
    slept = [rid for rid, path in calls if path == "/release_memory_occupation"]
    assert slept == ["a-r0", "c-r0", "b-r0"], "c (least recent) first, then b; p is pinned"
    assert models["a"].state.value == "awake" and models["p"].state.value == "awake"
    assert (models["b"].evictions, models["c"].evictions) == (1, 1)
    assert arena.asleep == {"b-r0", "c-r0"}, "the supervisor is told which runtimes sleep"


def test_a_busy_model_is_not_evicted_and_nothing_evictable_is_a_503_reason(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    arena = Arena(free=0, weights={"a-r0": 4, "b-r0": 2})
    manager, router = _setup(monkeypatch, calls, arena, [_spec("a"), _spec("b")], [100.0])

    async def run() -> None:
        await manager.sleep("a")
        arena.free = 0
        router.replicas["b"][0].inflight = 1  # b is serving a request
        with pytest.raises(CannotWake) as info:
            await manager.wake("a")
        assert "4 slab(s)" in str(info.value) and "busy or pinned" in str(info.value)
        with pytest.raises(NotElastic, match="in flight"):
            await manager.sleep("b")

    asyncio.run(run())
    assert manager.models["a"].state.value == "asleep", "a failed wake leaves it asleep"
    assert [p for _, p in calls].count("/resume_memory_occupation") == 0


def test_an_asleep_model_whose_runtime_is_restarting_wakes_by_the_restart(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    arena = Arena(free=0, weights={"a-r0": 4})
    manager, router = _setup(monkeypatch, calls, arena, [_spec("a")], [100.0])

    async def run() -> None:
        await manager.sleep("a")
        router.replicas["a"][0].up = False  # died while asleep: the supervisor restarts it
        await manager.wake("a")

    asyncio.run(run())
    assert manager.models["a"].state.value == "awake"
    assert "a-r0" not in arena.asleep, "probed again: the restarted runtime is awake"
    assert ("a-r0", "/resume_memory_occupation") not in calls, "no call to a dead runtime"


def test_a_model_that_is_not_elastic_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    manager, _ = _setup(monkeypatch, calls, Arena(0, {}), [], [0.0])
    with pytest.raises(NotElastic, match="not elastic"):
        asyncio.run(manager.sleep("fixed"))


def test_a_client_that_leaves_mid_wake_does_not_leave_the_model_half_awake(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    # Found in review: the wake ran in the request's task, so a client that disconnected
    # cancelled it between SGLang's two calls; the model stayed "waking" and the next request
    # spun on the loop. The wake is a shielded task of its own now.
    arena = Arena(free=10, weights={"a-r0": 4})
    manager, _ = _setup(monkeypatch, calls, arena, [_spec("a")], [100.0])

    async def run() -> None:
        await manager.sleep("a")
        arena.call_s = 0.05

        async def request() -> None:
            async with manager.use("a"):
                pass

        leaving = asyncio.ensure_future(request())
        await asyncio.sleep(0.02)  # inside the first wake call
        leaving.cancel()
        await asyncio.wait_for(request(), timeout=5)  # the next request is served

    asyncio.run(run())
    assert manager.models["a"].state.value == "awake"
    assert [p for _, p in calls].count("/resume_memory_occupation") == 1, "one wake, shared"
    assert manager.models["a"].entering == 0


def test_a_victim_whose_sleep_fails_is_not_asked_again_and_the_wake_gets_its_503(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    # Found in review: a victim whose runtime is down stays awake and idle, so the eviction
    # loop picked it again and again without ever yielding the event loop.
    arena = Arena(free=0, weights={"a-r0": 4, "b-r0": 2})
    manager, _ = _setup(monkeypatch, calls, arena, [_spec("a"), _spec("b")], [100.0])
    real_call = elastic._call

    async def failing_for_b(replica: FakeReplica, path: str, body: dict[str, object]) -> None:
        if replica.runtime_id == "b-r0" and path == "/release_memory_occupation":
            calls.append((replica.runtime_id, path))
            raise elastic.RuntimeControlFailed("b-r0 refused")
        await real_call(replica, path, body)

    monkeypatch.setattr(elastic, "_call", failing_for_b)

    async def run() -> None:
        await manager.sleep("a")
        arena.free = 0
        with pytest.raises(CannotWake, match="no idle model there"):
            await asyncio.wait_for(manager.wake("a"), timeout=5)

    asyncio.run(run())
    releases = [rid for rid, path in calls if path == "/release_memory_occupation"]
    assert releases == ["a-r0", "b-r0"], "b was asked once"
    assert manager.models["b"].state.value == "awake"


def test_a_wake_with_nothing_to_evict_waits_a_moment_for_room_freed_elsewhere(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    # Idle prefix caches of models that never sleep can hold the arena; the cache reclaimer
    # flushes them once it sees the waiting request, within a second or two. The wake waits
    # ROOM_WAIT_S for that before its 503.
    arena = Arena(free=0, weights={"a-r0": 4})
    manager, _ = _setup(monkeypatch, calls, arena, [_spec("a")], [100.0])
    monkeypatch.setattr(elastic, "ROOM_WAIT_S", 5.0)

    async def run() -> None:
        await manager.sleep("a")
        arena.free = 0

        async def reclaimer() -> None:
            await asyncio.sleep(0.3)
            arena.free = 6

        freeing = asyncio.ensure_future(reclaimer())
        await asyncio.wait_for(manager.wake("a"), timeout=5)
        await freeing

    asyncio.run(run())
    assert manager.models["a"].state.value == "awake"


def test_a_request_in_flight_counts_once_in_busy(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]]) -> None:
    # Issue #35: `ctl sleep`'s 409 said "2 request(s)" for one non-streamed request: it was
    # counted arriving (`entering`) and in flight (the replica) until it ended.
    arena = Arena(free=10, weights={"a-r0": 4})
    manager, router = _setup(monkeypatch, calls, arena, [_spec("a")], [100.0])

    async def run() -> None:
        async with manager.use("a") as queued:
            model = manager.models["a"]
            assert manager.busy(model) == 1, "arriving"
            router.queues["a"] = [object()]  # the queue takes it ...
            queued()
            assert manager.busy(model) == 1, "queued"
            router.queues["a"] = []
            router.replicas["a"][0].inflight = 1  # ... and leases it to the runtime
            assert manager.busy(model) == 1, "in flight"
            queued()  # a retry (RuntimeLost) queues it again: still once
            assert model.entering == 0
        router.replicas["a"][0].inflight = 0
        assert manager.busy(model) == 0

    asyncio.run(run())

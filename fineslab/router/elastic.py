"""Elastic models: an idle model sleeps, the first request wakes it (issue #16).

A model is elastic when its fleet config gives `idle_timeout_s` or `pinned`; its one runtime
keeps its weights in slabs of the device's arena (`FINESLAB_WEIGHTS_IN_ARENA`), so a sleeping
model gives its weights and its KV back to the arena for the other models there.

    awake --(idle for idle_timeout_s; `ctl sleep`; evicted to make room for a wake)--> sleeping
    sleeping --> asleep --(a request; `ctl wake`)--> waking --> awake

Sleep runs only while the model has nothing in flight, queued or arriving, in SGLang's safe
order (paused first, so that no step runs on released memory):
`POST /pause_generation {"mode": "retract"}`, then
`/release_memory_occupation {"tags": ["weights", "kv_cache"]}`. The runtime stays paused while
it sleeps, and the supervisor does not probe it (its probe generates, which on released weights
would fault). A request that arrives meanwhile waits for the sleep to end, then wakes it.

Wake: `/resume_memory_occupation`, then `/continue_generation`. SGLang cannot refuse a resume,
and a runtime asked to wake without room for its weights stops (the supervisor restarts it), so
the wake is asked only when the weight slabs it needs (counted from the slab table before it
slept) are free in its device's arena. When they are not, the least recently used idle awake
models of that device (not pinned) sleep first; when that is not enough the request gets 503
with the reason and `Retry-After`. Requests wait for one wake: their time to first token, as
the client sees it, includes the wake (the queue's TTFT clock starts once the model is awake).

Everything here runs on the router's event loop; one lock per model orders its transitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from fineslab.errors import TransientError
from fineslab.scheduler.elastic import AwakeView, ResidentView, idle_sleepers, lru_victims

if TYPE_CHECKING:
    from fineslab.router.metrics import RouterMetrics
    from fineslab.router.queues import ModelQueue
    from fineslab.router.replicas import Replica

logger = logging.getLogger(__name__)

#: How often idle models are looked for.
IDLE_CHECK_S = 1.0
#: Longest a runtime may take to answer one sleep or wake call.
CONTROL_TIMEOUT_S = 120.0
#: How long a wake with nothing left to evict waits for free slabs before its 503: the cache
#: reclaimer (fineslab.fleet.reclaim) flushes idle runtimes' prefix caches within about 1-2 s
#: once it sees the waiting request (Router.demand counts it).
ROOM_WAIT_S = 3.0
ROOM_POLL_S = 0.25
ControlCall = tuple[str, dict[str, object]]
SLEEP_CALLS: tuple[ControlCall, ...] = (
    ("/pause_generation", {"mode": "retract"}),
    ("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}))
WAKE_CALLS: tuple[ControlCall, ...] = (
    ("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}),
    ("/continue_generation", {}))


class ModelState(enum.Enum):
    AWAKE = "awake"
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"


class RouterState(Protocol):
    """What the elastic models read of their router (`fineslab.router.app.Router` is one): its
    replicas and queues by model, and its metrics."""

    @property
    def replicas(self) -> dict[str, list[Replica]]: ...

    @property
    def queues(self) -> dict[str, ModelQueue]: ...

    @property
    def metrics(self) -> RouterMetrics: ...


class CannotWake(TransientError):
    """The model cannot be woken now (HTTP 503 + Retry-After); the message says why."""


class NotElastic(Exception):
    """A sleep or wake asked of a model that is not elastic, or that is busy (HTTP 409)."""


@dataclass(frozen=True)
class ElasticSpec:
    """One elastic model: its runtime, its device, and when it sleeps."""

    name: str
    runtime_id: str
    device: str
    idle_timeout_s: float | None
    pinned: bool


@dataclass
class ElasticModel:
    spec: ElasticSpec
    state: ModelState = ModelState.AWAKE
    last_used_s: float = field(default_factory=time.monotonic)
    #: The weight slabs it held when it last slept: what a wake must find free.
    weight_slabs: int | None = None
    entering: int = 0  # requests between arrival and their queue (see `Elastic.use`)
    sleeps: int = 0
    wakes: int = 0
    evictions: int = 0
    last_wake_s: float | None = None
    last_sleep_s: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waking: asyncio.Future[None] | None = None

    def describe(self, now_s: float) -> dict[str, Any]:
        return {"model": self.spec.name, "state": self.state.value,
                "runtime_id": self.spec.runtime_id, "device": self.spec.device,
                "pinned": self.spec.pinned, "idle_timeout_s": self.spec.idle_timeout_s,
                "idle_for_s": round(now_s - self.last_used_s, 3),
                "weight_slabs": self.weight_slabs, "sleeps": self.sleeps, "wakes": self.wakes,
                "evictions": self.evictions, "last_wake_s": self.last_wake_s,
                "last_sleep_s": self.last_sleep_s}


@dataclass(frozen=True)
class ArenaView:
    """What the manager reads of the arenas (the fleet gives it; tests give fakes)."""

    free_slabs: Callable[[str], int | None]  # device -> free slabs weights can take (or None)
    weight_slabs: Callable[[str], int | None]  # runtime id -> weight slabs it holds now
    on_asleep: Callable[[str, bool], None]  # runtime id asleep or not (the supervisor)


class Elastic:
    """The elastic models of a router (module doc); `Router` calls `use`, `start`, `stop`."""

    def __init__(self, specs: list[ElasticSpec], arenas: ArenaView,
                 retry_after_s: int = 5, clock: Callable[[], float] = time.monotonic,
                 asleep: dict[str, int] | None = None) -> None:
        self.specs = {s.name: s for s in specs}
        #: Runtimes the launcher started asleep, with the weight slabs they gave back.
        self.started_asleep = dict(asleep or {})
        self.arenas, self.retry_after_s, self.clock = arenas, retry_after_s, clock
        self.models: dict[str, ElasticModel] = {}
        self.router: RouterState | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle (on the router's loop) -------------------------------------------------------

    def start(self, router: RouterState) -> None:
        self.router = router
        self.models = {name: ElasticModel(spec, last_used_s=self.clock())
                       for name, spec in self.specs.items()}
        for model in self.models.values():
            if model.spec.runtime_id in self.started_asleep:
                model.state = ModelState.ASLEEP
                model.weight_slabs = self.started_asleep[model.spec.runtime_id]
        self._task = asyncio.create_task(self._idle_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- requests -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[Callable[[], None]]:
        """Around a request for `name`: wakes the model (raises CannotWake) and counts the
        request as arriving (`entering`, which keeps the model from sleeping) until it calls
        what this yields, as its queue takes it (from then the queue or the replica counts
        it: a non-streamed request in flight was counted twice in `busy`, issue #35). Not
        elastic: nothing."""
        model = self.models.get(name)
        if model is None:
            yield lambda: None
            return
        model.entering += 1
        model.last_used_s = self.clock()
        arriving = True

        def queued() -> None:
            nonlocal arriving
            if arriving:
                arriving = False
                model.entering -= 1

        try:
            await self.ensure_awake(model)
            yield queued
        finally:
            queued()
            model.last_used_s = self.clock()

    async def ensure_awake(self, model: ElasticModel) -> None:
        """Wait until the model is awake, starting its wake if none runs; every waiter shares
        one wake task, shielded: a client that leaves does not cancel a wake half done."""
        while model.state is not ModelState.AWAKE:
            if model.waking is None or model.waking.done():
                model.waking = asyncio.ensure_future(self._wake_when_asleep(model))
            await asyncio.shield(model.waking)

    async def _wake_when_asleep(self, model: ElasticModel) -> None:
        async with model.lock:  # after a sleep under way
            if model.state is ModelState.ASLEEP:
                await self._wake(model)
            elif model.state is not ModelState.AWAKE:  # a transition left half done: a defect
                raise CannotWake(f"model {model.spec.name} is stuck {model.state.value}; "
                                 "see the router log")

    def busy(self, model: ElasticModel) -> int:
        """Requests arriving, queued or in flight for the model."""
        name = model.spec.name
        replicas = self._live.replicas.get(name, [])
        queued = len(self._live.queues[name]) if name in self._live.queues else 0
        return model.entering + queued + sum(r.inflight for r in replicas)

    # -- operator commands (ctl) ----------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        now_s = self.clock()
        out = []
        for m in self.models.values():
            row = m.describe(now_s)
            if m.state is ModelState.AWAKE:
                row["weight_slabs"] = self.arenas.weight_slabs(m.spec.runtime_id)
            out.append(row)
        return out

    def model(self, name: str) -> ElasticModel:
        model = self.models.get(name)
        if model is None:
            raise NotElastic(f"model {name!r} is not elastic (give it idle_timeout_s or pinned "
                             "in the fleet config): it never sleeps")
        return model

    async def sleep(self, name: str) -> ElasticModel:
        """`ctl sleep`: put the model to sleep now (pinned ones too); NotElastic when busy or
        when its runtime does not sleep (shielded, like a wake)."""
        model = self.model(name)
        await asyncio.shield(asyncio.ensure_future(self._sleep_when_idle(model)))
        return model

    async def _sleep_when_idle(self, model: ElasticModel) -> None:
        async with model.lock:
            if model.state is not ModelState.AWAKE:
                return
            busy = self.busy(model)
            if busy:
                raise NotElastic(f"model {model.spec.name} has {busy} request(s) queued or in "
                                 "flight; it sleeps once they finish (retry then)")
            if not await self._sleep(model, "asked by an operator"):
                raise NotElastic(f"model {model.spec.name} did not go to sleep (its runtime is "
                                 "down or refused; see the router log): it stays awake")

    async def wake(self, name: str) -> ElasticModel:
        """`ctl wake`: wake the model now; CannotWake when there is no room."""
        model = self.model(name)
        model.last_used_s = self.clock()
        await self.ensure_awake(model)
        return model

    # -- supervision ----------------------------------------------------------------------------

    def runtime_restarted(self, runtime_id: str) -> None:
        """A restarted runtime loads its weights: it is awake, whatever it was before."""
        for model in self.models.values():
            if model.spec.runtime_id == runtime_id and model.state is not ModelState.AWAKE:
                logger.info("model %s: its runtime restarted, so it is awake again",
                            model.spec.name)
                model.state = ModelState.AWAKE
                self.arenas.on_asleep(runtime_id, False)

    async def make_room_for_restart(self, runtime_id: str, need_slabs: int) -> None:
        """Before the supervisor restarts `runtime_id` (whose weights live in the arena): put
        least recently used idle models of its device to sleep until `need_slabs` are free.
        A restart loads the weights at start and, unlike a wake, cannot wait for room: without
        it the start fails and the supervisor backs off again and again. CannotWake when
        nothing can be evicted (the start is tried anyway)."""
        model = next((m for m in self.models.values() if m.spec.runtime_id == runtime_id), None)
        if model is not None:
            await self._make_room(model, need_slabs)

    # -- transitions (each under the model's lock) ----------------------------------------------

    async def _sleep(self, model: ElasticModel, why: str) -> bool:
        """AWAKE -> ASLEEP; on a failed call the model stays awake (or its runtime restarts)."""
        replica = self._replica(model)
        model.weight_slabs = self.arenas.weight_slabs(model.spec.runtime_id)
        model.state = ModelState.SLEEPING
        self.arenas.on_asleep(model.spec.runtime_id, True)
        start_s = time.perf_counter()
        try:
            for path, body in SLEEP_CALLS:
                await _call(replica, path, body)
        except RuntimeControlFailed as exc:
            logger.error("model %s: sleep failed (%s); it stays awake", model.spec.name, exc)
            with contextlib.suppress(RuntimeControlFailed):
                await _call(replica, "/continue_generation", {})
            model.state = ModelState.AWAKE
            self.arenas.on_asleep(model.spec.runtime_id, False)
            return False
        model.state = ModelState.ASLEEP
        model.sleeps += 1
        model.last_sleep_s = time.perf_counter() - start_s
        self._live.metrics.observe_sleep(model.spec.name, model.last_sleep_s)
        logger.info("model %s asleep (%s): %s weight slab(s) back to the arena of %s in %.3f s",
                    model.spec.name, why, model.weight_slabs, model.spec.device,
                    model.last_sleep_s)
        return True

    async def _wake(self, model: ElasticModel) -> None:
        """ASLEEP -> AWAKE, making room first; CannotWake (still asleep) when there is none."""
        replica = self._replica(model)
        if not replica.up:
            # Its runtime died while asleep and is being restarted: it comes back with its
            # weights loaded, and the queue waits for it (or answers 503 with its ETA).
            logger.info("model %s: its runtime is restarting, so it wakes by the restart",
                        model.spec.name)
            model.state = ModelState.AWAKE
            self.arenas.on_asleep(model.spec.runtime_id, False)
            return
        await self._make_room(model)
        model.state = ModelState.WAKING
        start_s = time.perf_counter()
        try:
            for path, body in WAKE_CALLS:
                await _call(replica, path, body)
        except RuntimeControlFailed as exc:
            # A runtime that failed its wake is restarted by the supervisor (it comes up awake).
            model.state = ModelState.AWAKE
            self.arenas.on_asleep(model.spec.runtime_id, False)
            raise CannotWake(f"model {model.spec.name} failed to wake ({exc}); its runtime is "
                             "restarted if it stopped") from None
        model.state = ModelState.AWAKE
        self.arenas.on_asleep(model.spec.runtime_id, False)
        model.wakes += 1
        model.last_wake_s = time.perf_counter() - start_s
        model.last_used_s = self.clock()
        self._live.metrics.observe_wake(model.spec.name, model.last_wake_s)
        logger.info("model %s awake in %.3f s", model.spec.name, model.last_wake_s)

    async def _make_room(self, model: ElasticModel, need_slabs: int | None = None) -> None:
        """Sleep least recently used idle models of the device until the weights fit
        (`need_slabs`, or the slabs the model held when it slept)."""
        need = need_slabs if need_slabs is not None else model.weight_slabs or 0
        device = model.spec.device
        tried: set[str] = set()  # a victim whose sleep failed is not asked again in this wake
        give_up_s = time.monotonic() + ROOM_WAIT_S
        while True:
            free = self.arenas.free_slabs(device)
            if free is None or free >= need:
                return
            # The policy's own order (scheduler/elastic.py, `lru-idle`), over this device.
            residents = [ResidentView(m.spec.name, m.weight_slabs or 0, m.last_used_s,
                                      busy=m.lock.locked() or self.busy(m) > 0,
                                      pinned=m.spec.pinned)
                         for m in self.models.values()
                         if m is not model and m.spec.device == device
                         and m.spec.name not in tried and m.state is ModelState.AWAKE]
            victims = [self.models[r.name] for r in lru_victims(residents, self.clock())]
            if not victims and time.monotonic() < give_up_s:
                await asyncio.sleep(ROOM_POLL_S)  # idle prefix caches may be flushed meanwhile
                continue
            if not victims:
                raise CannotWake(
                    f"model {model.spec.name} is asleep and cannot wake now: its weights need "
                    f"{need} slab(s) of the arena of {device}, which has {free} free, and no "
                    "idle model there can be put to sleep (the others are busy or pinned); "
                    "retry later")
            victim = victims[0]
            tried.add(victim.spec.name)
            async with victim.lock:
                if victim.state is ModelState.AWAKE and self.busy(victim) == 0 and \
                        await self._sleep(victim, f"evicted to wake {model.spec.name}"):
                    victim.evictions += 1
                    self._live.metrics.evicted(victim.spec.name)

    @property
    def _live(self) -> RouterState:
        assert self.router is not None, "Elastic.start was not called"
        return self.router

    def _replica(self, model: ElasticModel) -> Replica:
        return self._live.replicas[model.spec.name][0]

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            now_s = self.clock()
            awake = []
            for model in self.models.values():
                if model.state is not ModelState.AWAKE:
                    continue
                busy = model.lock.locked() or self.busy(model) > 0
                if busy and not model.lock.locked():
                    model.last_used_s = now_s
                awake.append(AwakeView(model.spec.name, model.last_used_s,
                                       model.spec.idle_timeout_s, busy))
            for name in idle_sleepers(awake, now_s):  # the policy (scheduler/elastic.py)
                model = self.models[name]
                try:
                    async with model.lock:
                        if model.state is ModelState.AWAKE and self.busy(model) == 0:
                            await self._sleep(model, f"idle for {model.spec.idle_timeout_s:g} s")
                except Exception:  # a defect here must not end the idle checks for good
                    logger.exception("putting idle model %s to sleep failed", model.spec.name)


class RuntimeControlFailed(Exception):
    pass


async def _call(replica: Replica, path: str, body: dict[str, object]) -> None:
    """One control call to the runtime; RuntimeControlFailed unless it answers 200."""
    if not replica.up:
        raise RuntimeControlFailed(f"runtime {replica.runtime_id} is down")
    try:
        async with replica.client.post(path, json=body, timeout=aiohttp.ClientTimeout(
                total=CONTROL_TIMEOUT_S)) as reply:
            text = await reply.text()
            if reply.status != 200:
                raise RuntimeControlFailed(f"{path} answered {reply.status}: {text[:200]}")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise RuntimeControlFailed(f"{path} failed: {type(exc).__name__}: {exc}") from None

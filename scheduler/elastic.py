"""Elastic placement policies: where a sleeping model wakes and whom it puts to sleep.

When a request arrives for a model whose weights are not on any GPU, something must decide on
which GPU it wakes and which idle models give their memory back for it. Two peers behind one
protocol, fed frozen snapshots, returning frozen decisions (the simulator and the live router
call them; the mechanism, slabs and sleep/wake, is elsewhere):

    lru-idle  fineslab (issue #16): a model has one home device (its runtime lives there);
              it wakes there. Short of free slabs, the least recently used idle awake models of
              that device sleep first (idle: nothing queued or running; pinned never). Idle
              models also sleep on their own after `idle_timeout_s`, so their memory is KV for
              their neighbours meanwhile.
    prism     Prism* (paper 002 section 6.1, "Model eviction and activation"): a model wakes
              on whichever GPU has the lowest KV pressure ratio after it is added (KVPR, as in
              the placer: sum of SLO-weighted token rates / KV bytes left), among the GPUs
              where it fits once models idle longer than the eviction threshold (45 s, the
              paper's best) are evicted, least recently used first. A model is evicted only
              when room is needed, never just for being idle.

A decision of None means "not now": nothing can make room; the caller retries when memory is
freed (the simulator) or answers 503 (the router).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fineslab.errors import ConfigError

#: Prism's eviction threshold (paper 002, appendix A.4: about 45 s is best on its traces).
PRISM_IDLE_THRESHOLD_S = 45.0


@dataclass(frozen=True)
class ResidentView:
    """An awake (or waking) model on a GPU, as a policy sees it."""

    name: str
    weight_slabs: int
    last_used_s: float
    busy: bool  # requests queued or running, or a transition in flight
    pinned: bool = False
    rate_weight: float = 0.0  # KVPR's SLO-weighted token rate of the model


@dataclass(frozen=True)
class GpuView:
    gpu_id: int
    num_slabs: int
    free_slabs: int
    slab_bytes: int
    residents: tuple[ResidentView, ...]


@dataclass(frozen=True)
class WakeRequest:
    name: str
    weight_slabs: int
    home_gpu: int | None  # the device its runtime lives on (lru-idle); None: any
    rate_weight: float
    now_s: float


@dataclass(frozen=True)
class WakeDecision:
    gpu_id: int
    evict: tuple[str, ...]  # put these to sleep first, in this order


class ElasticPolicy(Protocol):
    name: str

    def idle_timeout_s(self, model: str) -> float | None:
        """Seconds idle after which the model sleeps on its own (None: only when evicted)."""
        ...

    def wake(self, request: WakeRequest, gpus: Sequence[GpuView]) -> WakeDecision | None: ...


def lru_victims(residents: Sequence[ResidentView], now_s: float,
                min_idle_s: float = 0.0) -> list[ResidentView]:
    """Idle, unpinned residents idle for at least `min_idle_s`, least recently used first."""
    return sorted((r for r in residents if not r.busy and not r.pinned
                   and now_s - r.last_used_s >= min_idle_s), key=lambda r: r.last_used_s)


@dataclass(frozen=True)
class AwakeView:
    """An awake elastic model, as the idle check sees it."""

    name: str
    last_used_s: float
    idle_timeout_s: float | None  # None: it never sleeps on its own (pinned)
    busy: bool  # requests queued or running, or a transition in flight


def idle_sleepers(models: Sequence[AwakeView], now_s: float) -> tuple[str, ...]:
    """lru-idle's own sleep (module doc): the models idle for their `idle_timeout_s` or longer,
    least recently used first. (Prism* has none: it evicts only to make room.)"""
    return tuple(m.name for m in sorted(models, key=lambda m: m.last_used_s)
                 if m.idle_timeout_s is not None and not m.busy
                 and now_s - m.last_used_s >= m.idle_timeout_s)


def _room_with(gpu: GpuView, need: int, victims: list[ResidentView]) -> tuple[str, ...] | None:
    """The shortest LRU prefix of `victims` whose weight slabs, with the free ones, cover
    `need`; None when even all of them do not."""
    free, chosen = gpu.free_slabs, []
    for victim in victims:
        if free >= need:
            break
        chosen.append(victim.name)
        free += victim.weight_slabs
    return tuple(chosen) if free >= need else None


class LruIdlePolicy:
    """fineslab: wake at home, evict the least recently used idle models there."""

    name = "lru-idle"

    def __init__(self, idle_timeout_s: float | None = 30.0) -> None:
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ConfigError("idle_timeout_s must be positive (or None)")
        self._idle_timeout_s = idle_timeout_s

    def idle_timeout_s(self, model: str) -> float | None:
        return self._idle_timeout_s

    def wake(self, request: WakeRequest, gpus: Sequence[GpuView]) -> WakeDecision | None:
        home = next((g for g in gpus if g.gpu_id == request.home_gpu), None)
        if home is None:
            raise ConfigError(f"lru-idle: model {request.name} has no home GPU")
        evict = _room_with(home, request.weight_slabs,
                           lru_victims(home.residents, request.now_s))
        return WakeDecision(home.gpu_id, evict) if evict is not None else None


class PrismPolicy:
    """Prism*: wake on the lowest-KV-pressure GPU that fits after evicting long-idle models."""

    name = "prism"

    def __init__(self, idle_threshold_s: float = PRISM_IDLE_THRESHOLD_S) -> None:
        if idle_threshold_s < 0:
            raise ConfigError("idle_threshold_s must be >= 0")
        self.idle_threshold_s = idle_threshold_s

    def idle_timeout_s(self, model: str) -> float | None:
        return None

    def wake(self, request: WakeRequest, gpus: Sequence[GpuView]) -> WakeDecision | None:
        best: tuple[float, int, WakeDecision] | None = None
        for gpu in gpus:
            victims = lru_victims(gpu.residents, request.now_s, self.idle_threshold_s)
            evict = _room_with(gpu, request.weight_slabs, victims)
            if evict is None:
                continue
            staying = [r for r in gpu.residents if r.name not in evict]
            kv_slabs = (gpu.num_slabs - sum(r.weight_slabs for r in staying)
                        - request.weight_slabs)
            kv_bytes = max(1, kv_slabs) * gpu.slab_bytes
            pressure = (sum(r.rate_weight for r in staying) + request.rate_weight) / kv_bytes
            if best is None or (pressure, gpu.gpu_id) < best[:2]:
                best = (pressure, gpu.gpu_id, WakeDecision(gpu.gpu_id, evict))
        return best[2] if best is not None else None


ELASTIC_POLICIES = ("lru-idle", "prism")


def get_elastic_policy(name: str, idle_timeout_s: float | None = 30.0) -> ElasticPolicy:
    if name == "lru-idle":
        return LruIdlePolicy(idle_timeout_s)
    if name == "prism":
        return PrismPolicy()
    raise ConfigError(f"unknown elastic policy {name!r}; known: {ELASTIC_POLICIES}")

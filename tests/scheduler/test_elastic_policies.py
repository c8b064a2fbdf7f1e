"""Elastic placement policies (scheduler/elastic.py): where a model wakes, whom it evicts.

    GPU 0: 10 slabs, 2 free; residents a (3 slabs, used at t=5), b (4, t=1), c (1, t=9, busy)
    GPU 1: 10 slabs, 6 free; resident d (4, t=2)
"""

from __future__ import annotations

import pytest
from fineslab.scheduler.elastic import (
    AwakeView,
    GpuView,
    LruIdlePolicy,
    PrismPolicy,
    ResidentView,
    WakeDecision,
    WakeRequest,
    get_elastic_policy,
    idle_sleepers,
    lru_victims,
)

from fineslab.errors import ConfigError

SLAB = 1 << 20


def _gpus(d_rate: float = 1.0) -> list[GpuView]:
    return [
        GpuView(0, 10, 2, SLAB, (ResidentView("a", 3, 5.0, False, rate_weight=1.0),
                                 ResidentView("b", 4, 1.0, False, rate_weight=1.0),
                                 ResidentView("c", 1, 9.0, True, rate_weight=1.0))),
        GpuView(1, 10, 6, SLAB, (ResidentView("d", 4, 2.0, False, rate_weight=d_rate),)),
    ]


def _request(need: int, home: int | None = 0, now_s: float = 100.0) -> WakeRequest:
    return WakeRequest("new", need, home, 1.0, now_s)


def test_lru_victims_are_idle_unpinned_and_oldest_first() -> None:
    residents = [ResidentView("a", 1, 5.0, False), ResidentView("b", 1, 1.0, False),
                 ResidentView("busy", 1, 0.0, True), ResidentView("pin", 1, 0.0, False, True)]
    assert [r.name for r in lru_victims(residents, 10.0)] == ["b", "a"]
    assert [r.name for r in lru_victims(residents, 10.0, min_idle_s=6.0)] == ["b"]


def test_lru_idle_wakes_at_home_evicting_only_as_many_as_needed() -> None:
    policy = LruIdlePolicy()
    assert policy.wake(_request(2), _gpus()) == WakeDecision(0, ()), "free slabs suffice"
    assert policy.wake(_request(5), _gpus()) == WakeDecision(0, ("b",)), "2 free + b's 4"
    assert policy.wake(_request(8), _gpus()) == WakeDecision(0, ("b", "a")), "LRU order"
    assert policy.wake(_request(10), _gpus()) is None, "c is busy: never evicted"
    assert policy.wake(_request(5, home=1), _gpus()) == WakeDecision(1, ())


def test_lru_idle_needs_a_home() -> None:
    with pytest.raises(ConfigError, match="home"):
        LruIdlePolicy().wake(_request(1, home=None), _gpus())


def test_prism_picks_the_lowest_kv_pressure_gpu_that_fits() -> None:
    policy = PrismPolicy()
    # GPU 0 fits after evicting b, leaving 10 - (3 + 1) - 5 = 1 KV slab for 3 rate units;
    # GPU 1 fits at once with 10 - 4 - 5 = 1 slab for 2 units: lower pressure.
    assert policy.wake(_request(5, home=None), _gpus()) == WakeDecision(1, ())
    # A busy neighbour on GPU 1 (rate 10) makes GPU 0 the lower pressure.
    assert policy.wake(_request(5, home=None), _gpus(d_rate=10.0)) == WakeDecision(0, ("b",))


def test_prism_evicts_only_models_idle_past_its_threshold() -> None:
    policy = PrismPolicy(idle_threshold_s=45.0)
    assert policy.wake(_request(9, home=None, now_s=30.0), _gpus()) is None, \
        "nobody idle 45 s at t=30"
    assert policy.wake(_request(9, home=None, now_s=50.0), _gpus()) == \
        WakeDecision(1, ("d",)), "at t=50 d (idle since 2) goes"
    assert policy.idle_timeout_s("x") is None, "Prism never sleeps a model just for idling"


def test_policies_are_chosen_by_name() -> None:
    assert get_elastic_policy("lru-idle", 12.0).idle_timeout_s("m") == 12.0
    assert get_elastic_policy("prism").name == "prism"
    with pytest.raises(ConfigError):
        get_elastic_policy("random")


def test_idle_models_sleep_after_their_own_timeout_least_recently_used_first() -> None:
    """At t=100: x idle 40 s of its 30, y idle 60 s of its 60, z busy, p pinned (no timeout),
    w idle 10 s of its 30."""
    awake = [AwakeView("x", 60.0, 30.0, False), AwakeView("y", 40.0, 60.0, False),
             AwakeView("z", 0.0, 30.0, True), AwakeView("p", 0.0, None, False),
             AwakeView("w", 90.0, 30.0, False)]
    assert idle_sleepers(awake, 100.0) == ("y", "x")
    assert idle_sleepers(awake, 69.0) == (), "none idle long enough yet"

"""SwiftCache lending, live (scheduler/swiftcache.py): Algorithm 1 by hand, and the budget.

Most cases: a lender of capacity K = 1000 slabs, MEU 100, checks every c = 1 s; the expected
allocation N after each `observe` is derived in the comment beside it.
"""

from __future__ import annotations

import random

import pytest
from fineslab.scheduler.swiftcache import ElasticAllocation, lend_budget

from fineslab.errors import ConfigError
from fineslab.sim.lenders import elastic_offers


def _feed(alloc: ElasticAllocation, samples: list[tuple[float, int]]) -> list[int]:
    return [alloc.observe(t, d) for t, d in samples]


def test_a_demand_above_the_allocation_scales_up_at_once() -> None:
    alloc = ElasticAllocation(1000, 100, window_s=5.0, check_s=1.0)
    assert _feed(alloc, [(0.0, 0), (1.0, 0), (1.5, 250), (1.6, 420)]) == [
        1000,  # t=0: it starts holding all of K
        0,  # t=1: the first check; the window's max is 0, so all 1000 (10 MEUs) go
        300,  # t=1.5: 250 > 0, ceil(250 / 100) = 3 MEUs, with no check due (0.5 s after)
        500,  # t=1.6: 420 > 300, ceil(120 / 100) = 2 MEUs more, still no check
    ], "ScaleUp happens at the sample, not at the next check"


def test_no_scale_down_before_check_s() -> None:
    alloc = ElasticAllocation(1000, 100, window_s=5.0, check_s=1.0)
    assert _feed(alloc, [(0.0, 0), (0.5, 0), (0.99, 0)]) == [1000, 1000, 1000], \
        "idle, but less than check_s since the first sample: N stays K"
    assert alloc.observe(1.0, 0) == 0, "control: at check_s after the first sample it shrinks"
    now_only = ElasticAllocation(1000, 100, window_s=0.0, check_s=1.0)  # window: D(t) alone
    assert _feed(now_only, [(0.0, 0), (1.0, 0), (1.2, 500), (1.5, 0), (1.99, 0), (2.0, 0)]) == [
        1000,
        0,  # t=1: the first check
        500,  # t=1.2: up 5 MEUs
        500, 500,  # t=1.5, 1.99: idle, but under check_s since the check at t=1
        0,  # t=2: the next check; the window holds only D(2) = 0
    ]


def test_a_check_scales_down_to_the_window_max_in_whole_meus() -> None:
    alloc = ElasticAllocation(1000, 100, window_s=5.0, check_s=1.0)
    assert _feed(alloc, [(0.0, 0), (0.5, 350), (1.0, 120)]) == [
        1000,
        1000,  # 350 fits in 1000: no ScaleUp
        400,  # check: window max 350, excess 650 -> floor(650 / 100) = 6 MEUs released
    ]
    assert alloc.headroom(120) == 280, "N - D: what it keeps beyond its use now"
    odd = ElasticAllocation(1000, 300, window_s=5.0, check_s=1.0)
    assert _feed(odd, [(0.0, 0), (1.0, 0)]) == [1000, 100], \
        "an MEU not dividing K: floor(1000 / 300) = 3 MEUs go, 100 stays held"


def test_a_burst_inside_the_window_keeps_the_allocation_up() -> None:
    alloc = ElasticAllocation(1000, 100, window_s=4.5, check_s=1.0)
    steady = [(t, 100) for t in (3.0, 4.0, 5.0, 6.0, 7.0)]
    assert _feed(alloc, [(0.0, 0), (1.0, 0), (2.0, 800), (2.6, 100), *steady, (8.0, 100)]) == [
        1000,
        0,  # t=1: check, window max 0
        800,  # t=2: up 8 MEUs; the check then sees 800 in its window, keeps it
        800,  # t=2.6: no check (0.6 s since the last)
        800, 800, 800, 800,  # t=3..6: the window (t - 4.5, t] holds the burst at 2.0
        800,  # t=7: window (2.5, 7]; the burst at 2.0 is still in force at 2.5, so it counts
        100,  # t=8: window (3.5, 8]; in force at 3.5 is 100 (t=3): 7 MEUs go
    ]


def test_a_demand_above_capacity_holds_the_allocation_at_capacity() -> None:
    alloc = ElasticAllocation(1000, 400, window_s=2.0, check_s=1.0)
    assert _feed(alloc, [(0.0, 0), (1.0, 0)]) == [1000, 200], "floor(1000 / 400) = 2 MEUs go"
    assert alloc.observe(1.5, 5000) == 1000, "not 200 + ceil(4800 / 400) * 400 = 5000"
    assert alloc.headroom(5000) == 0, "never a negative headroom"
    assert alloc.observe(2.0, 5000) == 1000, "a check with the clamped max 1000 keeps K"
    assert _feed(alloc, [(2.5, 0), (3.0, 0), (4.0, 0), (5.0, 0)]) == [1000, 1000, 1000, 200], \
        "t=3, 4: the 5000 (in force until 2.5) is in the 2 s window; t=5: it is not"


def test_bad_arguments_raise_config_error() -> None:
    for args in [(-1, 100, 5.0, 1.0), (1000, 0, 5.0, 1.0), (1000, 100, -1.0, 1.0),
                 (1000, 100, 5.0, 0.0)]:
        with pytest.raises(ConfigError):
            ElasticAllocation(*args)
    alloc = ElasticAllocation(1000, 100, window_s=5.0, check_s=1.0)
    alloc.observe(2.0, 10)
    with pytest.raises(ConfigError, match="time went back"):
        alloc.observe(1.0, 10)
    with pytest.raises(ConfigError, match="demand"):
        alloc.observe(3.0, -1)
    with pytest.raises(ConfigError, match="negative"):
        lend_budget(10, [-1], 0, 10)


def test_seeded_random_demand_keeps_the_invariants_and_bounded_memory() -> None:
    rng = random.Random(3)
    capacity, meu = 1000, 64
    alloc = ElasticAllocation(capacity, meu, window_s=5.0, check_s=1.0)
    now = 0.0
    for step in range(5000):
        now += rng.uniform(0.3, 0.7)
        demand = rng.choice([0, rng.randrange(0, capacity), rng.randrange(0, 3 * capacity)])
        n = alloc.observe(now, demand)
        assert min(demand, capacity) <= n <= capacity, f"step {step}: N covers D, within K"
        assert (capacity - n) % meu == 0, f"step {step}: K - N is whole MEUs"
        assert len(alloc._samples) <= 5.0 / 0.3 + 2, f"step {step}: only the window is kept"


def test_lend_budget_leaves_the_lenders_headroom_free() -> None:
    assert lend_budget(100, [20, 30], lent=10, cap=1000) == 60, "10 + 100 - 50"
    assert lend_budget(100, [], lent=10, cap=1000) == 110, "no lender: all it holds and free"


def test_lend_budget_is_bounded_by_the_cap() -> None:
    assert lend_budget(100, [20, 30], lent=10, cap=40) == 40, "60 allowed, the cap is 40"


def test_lend_budget_is_never_negative() -> None:
    assert lend_budget(10, [50], lent=0, cap=100) == 0, "10 - 50 < 0"
    assert lend_budget(10, [50], lent=20, cap=100) == 0, "20 + 10 - 50 < 0: give all back"


def test_lend_budget_keeps_the_low_water_mark_free() -> None:
    assert lend_budget(100, [20, 30], lent=10, cap=1000, low_water=25) == 35, "60 - 25"


def test_the_live_allocation_gives_the_simulators_offers_at_every_check() -> None:
    rng = random.Random(11)
    capacity, meu, cap, window_s, check_s, horizon_s = 1000, 64, 700, 3.0, 1.0, 40.0
    times = sorted(rng.sample(range(1, 160), 40))
    demand = [(0.0, 0)] + [(k * 0.25, rng.choice([0, rng.randrange(1500)])) for k in times]
    points = elastic_offers(demand, capacity, meu, cap, window_s, check_s, horizon_s)
    ticks = [k * check_s for k in range(1, int(horizon_s / check_s) + 1)]
    alloc = ElasticAllocation(capacity, meu, window_s, check_s)
    live, simulated = [], []
    for t in sorted({s for s, _ in demand} | set(ticks)):
        n = alloc.observe(t, [d for s, d in demand if s <= t][-1])
        if t in ticks:
            live.append(min(capacity - n, cap))
            simulated.append([b for s, b in points if s <= t][-1])
    assert live == simulated, "Algorithm 1 live and offline agree at the check ticks"
    assert len(set(live)) > 3, "control: the offers do change over the run"


def test_the_lending_policy_splits_what_the_lenders_do_not_keep() -> None:
    from fineslab.scheduler.swiftcache import BorrowerTerms, LendingUse, PrefixLendPolicy

    policy = PrefixLendPolicy([BorrowerTerms("chat", 0.5, 10.0, 1.0),
                               BorrowerTerms("chat2", 0.5, 10.0, 1.0)], low_free_fraction=0.1)
    use = LendingUse("cpu", ("chat", "chat2", "idle"), 100, 60, {"chat": 10, "chat2": 10,
                                                                 "idle": 20}, {"chat": 4})
    caps = policy.decide(use, 0.0)
    assert caps is not None
    # free unlent 56, split 28 each; the lender (first sample, N = K = 100) keeps 80 of
    # headroom: nothing to lend beyond what chat holds already (budget min(50, 4 + 28 - 80 -
    # 10) = 0).
    assert caps.caps == {"chat": 0, "chat2": 0} and "headroom 80" in caps.reason
    later = policy.decide(use, 2.0)  # the check shrank N to the window's largest D (20)
    assert later is not None and later.caps == {"chat": 22, "chat2": 18}
    assert policy.decide(LendingUse("cpu", ("idle",), 100, 60, {"idle": 20}, {}), 3.0) is None

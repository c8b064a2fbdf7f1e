"""The elastic simulator (fineslab.sim.elastic): sleep, wake, eviction on real slab tables.

Fleet of these tests: three 8B FP16 models (15 GiB of weights each) on one 40 GiB GPU
(38 GiB in its table after the activation reserve): two fit awake at once, never three.
"""

from __future__ import annotations

from collections import Counter

import pytest
from fineslab.scheduler.placement import GpuSpec
from fineslab.scheduler.profile_schema import Workload
from fineslab.scheduler.roofline import analytical_profile

from fineslab.sim.config import SimConfig
from fineslab.sim.elastic import ElasticSimConfig, ElasticSimulator, home_gpus, simulate_elastic
from fineslab.sim.simulator import FleetModel
from fineslab.workload import Request

GIB = 1 << 30
PROFILE = analytical_profile("llama-3.1-8b", "fp16", "h100", workload=Workload(512, 64))
MODELS = [FleetModel(f"m{i}", PROFILE, 1.0, 5.0) for i in range(3)]
ONE_GPU = [GpuSpec(0, 40 * GIB, "h100")]
CONFIG = SimConfig(check_integrity=True)


def _req(model: str, at_s: float, i: int) -> Request:
    return Request(f"{model}-{i}", model, at_s, 256, 16)


def _run(requests: list[Request], policy: str = "lru-idle", duration_s: float = 60.0,
         **elastic: float) -> tuple[ElasticSimulator, list]:
    sim = ElasticSimulator(MODELS, ONE_GPU, "adaptive", CONFIG,
                           ElasticSimConfig(policy=policy, **elastic))  # type: ignore[arg-type]
    try:
        outcomes = sim.run(requests, duration_s)
    finally:
        sim.close()
    return sim, outcomes


def test_a_request_to_a_sleeping_model_waits_for_its_wake() -> None:
    elastic = ElasticSimConfig()
    sim, outcomes = _run([_req("m0", 1.0, 0)])
    (served,) = outcomes
    wake_s = elastic.wake_s(PROFILE.weights_bytes)
    assert served.completed and served.ttft_s is not None
    assert served.ttft_s >= wake_s, "its time to first token includes the wake"
    assert sim.slots["m0"].wakes == 1


def test_a_third_model_evicts_the_least_recently_used_idle_one() -> None:
    requests = [_req("m0", 1.0, 0), _req("m1", 2.0, 1), _req("m2", 10.0, 2)]
    sim, outcomes = _run(requests)
    assert all(o.completed for o in outcomes)
    assert sim.slots["m0"].evictions == 1 and sim.slots["m1"].evictions == 0, \
        "m0, used first, is the one put to sleep"


def test_idle_models_sleep_after_the_timeout_under_lru_idle_but_not_under_prism() -> None:
    requests = [_req("m0", 1.0, 0)]
    lru, _ = _run(requests, duration_s=20.0, idle_timeout_s=5.0)
    assert lru.slots["m0"].state == "asleep", "idle 5 s: asleep, its slabs back in the arena"
    prism, _ = _run(requests, policy="prism", duration_s=20.0)
    assert prism.slots["m0"].state == "awake", "Prism evicts only under pressure"


def test_prism_does_not_evict_a_model_idle_less_than_its_threshold() -> None:
    requests = [_req("m0", 1.0, 0), _req("m1", 2.0, 1), _req("m2", 10.0, 2)]
    sim, outcomes = _run(requests, policy="prism", duration_s=120.0)
    m2 = next(o for o in outcomes if o.model == "m2")
    assert m2.dropped == "deadline", "m2 woke only once m0 had idled 45 s: past its 5 s SLO"
    assert sim.slots["m0"].evictions == 1 and sim.slots["m2"].wakes == 1
    _, served = _run(requests, duration_s=120.0)
    assert next(o for o in served if o.model == "m2").completed, \
        "lru-idle evicts the idle m0 at once and serves m2 within its SLO"


def test_every_request_ends_once_and_tables_stay_consistent() -> None:
    requests = [_req(f"m{i % 3}", 0.5 * i, i) for i in range(60)]
    _, outcomes = _run(requests)  # check_integrity after every event
    counts = Counter(o.request_id for o in outcomes)
    assert set(counts) == {r.request_id for r in requests} and max(counts.values()) == 1


def test_homes_balance_expected_weight_traffic() -> None:
    gpus = [GpuSpec(i, 80 * GIB, "h100") for i in range(2)]
    homes = home_gpus(MODELS, gpus)
    assert sorted(Counter(homes.values()).values()) == [1, 2]


@pytest.mark.parametrize("policy", ["lru-idle", "prism"])
def test_the_same_run_twice_gives_the_same_outcomes(policy: str) -> None:
    requests = [_req(f"m{i % 3}", 0.7 * i, i) for i in range(30)]
    one = simulate_elastic(MODELS, ONE_GPU, "adaptive", requests, 30.0, CONFIG,
                           ElasticSimConfig(policy=policy))
    two = simulate_elastic(MODELS, ONE_GPU, "adaptive", requests, 30.0, CONFIG,
                           ElasticSimConfig(policy=policy))
    assert one == two

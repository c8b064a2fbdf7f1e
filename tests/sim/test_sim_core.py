"""The simulator core: determinism, conservation, KV bounded by the real slab tables."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from fineslab.scheduler.placement import GpuSpec
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.profile_schema import Workload
from fineslab.scheduler.roofline import analytical_profile

from fineslab.errors import ConfigError
from fineslab.sim.config import SYSTEMS, SimConfig, SystemSpec
from fineslab.sim.simulator import FleetModel, Simulator, simulate
from fineslab.workload import SHAREGPT_STATS, ModelLoad, Request, WorkloadSpec, build_workload

GIB = 1 << 30
MIX = (("llama-3.1-8b", "fp16", 2.0), ("llama-3.1-8b", "fp8", 2.0), ("llama-3-8b", "qoq", 2.0))


def _models(slo_scale: float = 10.0) -> list[FleetModel]:
    workload = Workload(1024, 256)
    models = []
    for model, precision, rate in MIX:
        profile = analytical_profile(model, precision, "h100", workload=workload)
        slo_s = ChunkedPrefillPredictor.from_profile(profile).ttft_s([2048]) * slo_scale
        models.append(FleetModel(f"{model}-{precision}", profile, rate, slo_s))
    return models


def _gpus(num: int = 2, memory_gib: float = 24.0) -> list[GpuSpec]:
    """Small GPUs so that KV is scarce and the allocator is exercised."""
    return [GpuSpec(i, int(memory_gib * GIB), "h100") for i in range(num)]


def _requests(models: list[FleetModel], seed: int, duration_s: float = 10.0) -> list[Request]:
    spec = WorkloadSpec(tuple(ModelLoad(m.name, m.rate_per_s) for m in models), duration_s,
                        SHAREGPT_STATS, rate_scale=4.0, max_prompt_tokens=4096,
                        max_output_tokens=512, seed=seed)
    return build_workload(spec)


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_same_seed_same_outcomes(system: str) -> None:
    models = _models()
    first = simulate(models, _gpus(), SYSTEMS[system], _requests(models, 1), 10.0)
    again = simulate(models, _gpus(), SYSTEMS[system], _requests(models, 1), 10.0)
    assert first.outcomes == again.outcomes, "a seeded run is reproducible outcome by outcome"
    assert first.num_events == again.num_events


def test_other_seed_other_outcomes() -> None:
    models = _models()
    one = simulate(models, _gpus(), SYSTEMS["fineslab"], _requests(models, 1), 10.0)
    two = simulate(models, _gpus(), SYSTEMS["fineslab"], _requests(models, 2), 10.0)
    assert one.outcomes != two.outcomes


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_every_request_finishes_or_drops_exactly_once(system: str) -> None:
    models = _models(slo_scale=2.0)  # tight SLOs: adaptive batching drops some
    requests = _requests(models, 3)
    result = simulate(models, _gpus(), SYSTEMS[system], requests, 10.0)
    counts = Counter(o.request_id for o in result.outcomes)
    assert set(counts) == {r.request_id for r in requests}, "no request lost or invented"
    assert max(counts.values()) == 1, "no request has two outcomes"
    for outcome in result.outcomes:
        assert outcome.completed != (outcome.dropped is not None)
        if outcome.completed:
            original = next(r for r in requests if r.request_id == outcome.request_id)
            assert outcome.output_tokens == original.output_tokens, "all output tokens emitted"
            assert outcome.ttft_s is not None and outcome.e2e_s is not None
            assert 0 < outcome.ttft_s <= outcome.e2e_s


def test_adaptive_drops_for_deadlines_and_fcfs_never_does() -> None:
    models = _models(slo_scale=3.0)
    requests = _requests(models, 4)
    fineslab = simulate(models, _gpus(), SYSTEMS["fineslab"], requests, 10.0).outcomes
    static = simulate(models, _gpus(), SYSTEMS["static"], requests, 10.0).outcomes
    assert any(o.dropped == "deadline" for o in fineslab), "Algorithm 2 drops hopeless requests"
    assert not any(o.dropped == "deadline" for o in static), "FCFS never drops for a deadline"


@pytest.mark.parametrize("system", ["fineslab", "static"])
def test_kv_never_exceeds_the_arena(system: str) -> None:
    models = _models()
    config = SimConfig(check_integrity=True)  # the slab tables' invariants after every event
    sim = Simulator(models, _gpus(), SYSTEMS[system], config)
    try:
        peak_fraction = 0.0
        original_start = sim._try_start

        def watched(index: int, now_s: float) -> None:
            nonlocal peak_fraction
            original_start(index, now_s)
            for table in sim.kv.tables:
                capacity = table.dims.num_slabs * table.dims.slab_bytes
                used = sum(int(table.used[s]) * int(table.key[s])
                           for s in range(table.dims.num_slabs))
                assert used <= capacity, "KV in use never exceeds the table's slabs"
                peak_fraction = max(peak_fraction, used / capacity)

        sim._try_start = watched  # type: ignore[method-assign]
        sim.run(_requests(models, 5, duration_s=6.0))
    finally:
        sim.close()
    assert peak_fraction > 0.5, "the workload actually fills the arena (the test has teeth)"


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_token_throughput_counts_decode_tokens_of_every_request(system: str) -> None:
    # The paper's metric: output tokens per second "during the decode phase, excluding
    # prefill", SLO met or not. With a window past the last completion it is every completed
    # request's output tokens but the first (the prefill emits that one).
    models = _models(slo_scale=2.0)
    requests = _requests(models, 6)
    result = simulate(models, _gpus(), SYSTEMS[system], requests, window_s=1e9)
    completed = [o for o in result.outcomes if o.completed]
    assert result.window_output_tokens == sum(o.output_tokens - 1 for o in completed)


def _cpu_fleet(cpu_cores: int | None) -> list[float]:
    """Three replicas of one CPU model on one CPU device, one 256-token prompt each at t=0:
    the prefill times in the order they started (each a multiple of the alone time)."""
    profile = analytical_profile("llama-3.1-8b", "fp16", "h100", workload=Workload(256, 8))
    profile = replace(profile, device="cpu")
    models = [FleetModel(f"m{i}", profile, 0.1, 1e6) for i in range(3)]
    gpus = [GpuSpec(0, 3 * profile.weights_bytes + 8 * GIB, "cpu")]
    requests = [Request(f"r{i}", f"m{i}", 0.0, 256, 1) for i in range(3)]
    config = SimConfig(cpu_cores=cpu_cores, interference_per_neighbor=0.2)
    outcomes = simulate(models, gpus, SYSTEMS["static"], requests, 10.0, config).outcomes
    alone = profile.prefill_s(256)
    return sorted(round(o.ttft_s / alone, 3) for o in outcomes if o.ttft_s is not None)


def test_cpu_replicas_take_turns_on_the_cores() -> None:
    # Two cores, three runtimes of one thread each: the third to start shares the cores with
    # the two busy ones (3 threads / 2 cores); the first two each have a core.
    assert _cpu_fleet(cpu_cores=2) == [1.0, 1.0, 1.5]
    # Sixty cores: 20 threads each, 60 busy: no slowdown at all.
    assert _cpu_fleet(cpu_cores=60) == [1.0, 1.0, 1.0]
    # Negative control: without cores the device is a GPU, 1 + 0.2 x busy neighbours.
    assert _cpu_fleet(cpu_cores=None) == [1.0, 1.2, 1.4]


def test_cpu_cores_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="cpu_cores"):
        SimConfig(cpu_cores=0)
    with pytest.raises(ConfigError, match="squeeze_idle_s"):
        SimConfig(squeeze_idle_s=-0.5)  # an obey before the post would run time backwards


def _cached_fleet(prefix_cache: bool, squeeze: bool = False, device: str = "h100"
                  ) -> dict[str, float]:
    """Two 8B models sharing a 2 GiB arena: model a's four 4,000-token requests finish by
    t = 5 s and, with the prefix cache, keep their blocks (the arena nearly full); a asks again
    at 6.3 s, b at 10.3 s. TTFT by request."""
    profile = analytical_profile("llama-3.1-8b", "fp16", "h100", workload=Workload(4000, 1))
    profile = replace(profile, device=device) if device == "cpu" else profile
    models = [FleetModel(name, profile, 0.1, 1e6) for name in ("a", "b")]
    fixed = 2 * (profile.weights_bytes + int(profile.activation_bytes(1)))
    gpus = [GpuSpec(0, fixed + 2 * GIB, device)]
    requests = [Request(f"a{i}", "a", 0.5 * i, 4000, 1) for i in range(4)]
    requests += [Request("b", "b", 10.3, 4000, 1), Request("a-again", "a", 6.3, 4000, 1)]
    config = SimConfig(prefix_cache=prefix_cache, cache_squeeze=squeeze)
    system = SystemSpec("shared-fcfs", "mme", "fcfs", "shared")
    outcomes = simulate(models, gpus, system, requests, 30.0, config).outcomes
    assert all(o.completed for o in outcomes), outcomes
    return {o.request_id: o.ttft_s for o in outcomes if o.ttft_s is not None}


def test_a_neighbours_cache_holds_the_arena_until_the_reclaim_round_flushes_it() -> None:
    alone = _cached_fleet(prefix_cache=False)
    cached = _cached_fleet(prefix_cache=True)
    prefill = alone["b"]
    assert prefill < 0.5, "the arena had room at once without the cache"
    # b waits for the next round (every second: at 11 s), which flushes idle a's cache
    assert cached["b"] == pytest.approx(11.0 - 10.3 + prefill, abs=1e-6)
    # a's own request evicts a's own cache at once, as SGLang evicts for its own requests
    assert cached["a-again"] == pytest.approx(alone["a-again"], rel=1e-6)


def test_with_the_cache_squeeze_a_neighbours_cache_comes_back_at_its_next_turn() -> None:
    alone = _cached_fleet(prefix_cache=False)
    prefill = alone["b"]
    # On a GPU the idle neighbour's scheduler loop turns at once: b waits for nothing.
    assert _cached_fleet(prefix_cache=True, squeeze=True)["b"] == pytest.approx(prefill,
                                                                                rel=1e-6)
    # On a CPU SGLang's idle sleeper wakes once a second: squeeze_idle_s (0.5 s) on average,
    # before the 0.7 s the reclaim round costs.
    cpu_alone = _cached_fleet(prefix_cache=False, device="cpu")["b"]
    cpu = _cached_fleet(prefix_cache=True, squeeze=True, device="cpu")["b"]
    assert cpu == pytest.approx(0.5 + cpu_alone, abs=1e-6)
    # The control: without the squeeze, the round at 11 s.
    assert _cached_fleet(prefix_cache=True, device="cpu")["b"] == pytest.approx(
        11.0 - 10.3 + cpu_alone, abs=1e-6)

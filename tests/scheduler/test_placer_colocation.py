"""The MME placer told what co-location costs (`PlacementConfig.interference_per_neighbor`).

Issue 7's fig10 gap: Algorithm 1 scores memory only and stacked three replicas on one GPU,
whose steps then ran 1.4x-1.6x slower in the simulator. Told the factor f, the placer charges
each neighbour k at its expected busy fraction u_k = rate / capacity at its sized batch
(clamped to [0, 1]), divides each member's mu by 1 + f * sum u_k and keeps a replica off a
GPU where a resident would lose its last operating point within its TTFT SLO; told 0 it is
the paper's Algorithm 1.

The fleet used below, on 2 H100s, f = 0.5 (profiles: 1,024-token prompts):

    big  Llama-3.1-70B AWQ   0.5 req/s, SLO 5 s     placed first (largest F_M), GPU 0
    x    Llama-3.1-8B FP8    4 req/s,   SLO 0.3 s   alone: batch 8 (5.57 req/s, TTFT 0.115 s),
                                                    u = 4 / 5.57 = 0.72
                             beside y (load 0.59, x1.30): batch 8, 4.30 req/s: ok
                             beside y and z (load 1.13, x1.56): batch 8 3.56 req/s < 4,
                                 batch 16 TTFT 0.36 s > 0.3: broken
                             worst case, y always busy (x1.5): batch 8 3.71 req/s, batch 16
                                 0.35 s: broken already beside y
    y    Llama-3.1-8B AWQ    4 req/s,   SLO 2 s     batch 8 (6.77 req/s), u = 0.59
    z    Llama-3-8B QoQ      1 req/s,   SLO 2 s     batch 2 (1.86 req/s), u = 0.54; placed
                                                    last; memory scores want GPU 1
"""

from __future__ import annotations

import pytest
from fineslab.scheduler.placement import (
    ModelDemand,
    PlacementConfig,
    PlacementPlan,
    get_placement_policy,
)
from fineslab.scheduler.placement.colocation import Colocation
from fineslab.scheduler.placement.sizing import point_for, size_model
from fineslab.scheduler.placement.state import ClusterState, Replica, make_replicas
from placer_support import PROFILES, h100s

from fineslab.errors import ConfigError

TIGHT_X_SLO_S = 0.3
LOOSE_X_SLO_S = 2.0


def fleet(x_slo_s: float) -> list[ModelDemand]:
    return [ModelDemand("big", PROFILES["llama-3.1-70b--awq--h100"], 0.5, 5.0),
            ModelDemand("x", PROFILES["llama-3.1-8b--fp8--h100"], 4.0, x_slo_s),
            ModelDemand("y", PROFILES["llama-3.1-8b--awq--h100"], 4.0, 2.0),
            ModelDemand("z", PROFILES["llama-3-8b--qoq--h100"], 1.0, 2.0)]


def place(policy: str, interference: float, x_slo_s: float) -> dict[str, tuple[int, ...]]:
    plan = get_placement_policy(policy, PlacementConfig(interference)).place(
        fleet(x_slo_s), h100s(2))
    return {r.model: r.gpu_ids for r in plan.replicas}


def test_config_rejects_a_negative_factor() -> None:
    with pytest.raises(ConfigError, match="interference_per_neighbor"):
        PlacementConfig(interference_per_neighbor=-0.1)


@pytest.mark.parametrize("policy", ["mme", "static"])
def test_without_interference_the_third_replica_stacks_as_in_algorithm_1(policy: str) -> None:
    gpus = place(policy, 0.0, TIGHT_X_SLO_S)
    assert gpus == {"big": (0,), "x": (1,), "y": (1,), "z": (1,)}, \
        "factor 0 is the paper's memory-only placement: z joins x and y on GPU 1"
    assert PlacementConfig().interference_per_neighbor == 0.0, "Algorithm 1 by default"
    default = get_placement_policy(policy).place(fleet(TIGHT_X_SLO_S), h100s(2))
    assert {r.model: r.gpu_ids for r in default.replicas} == gpus, "the default factor is 0"


@pytest.mark.parametrize("policy", ["mme", "mme-exact", "static"])
def test_interference_keeps_a_third_replica_off_a_gpu_whose_resident_slo_breaks(
        policy: str) -> None:
    gpus = place(policy, 0.5, TIGHT_X_SLO_S)
    assert gpus["x"] == gpus["y"] == (1,), \
        "y's expected load (x1.30) leaves x batch 8 at 4.30 req/s: they share GPU 1"
    assert gpus["z"] == (0,), "z beside x and y would leave x no batch within its SLO"


@pytest.mark.parametrize("policy", ["mme", "static"])
def test_with_loose_slos_the_same_factor_still_stacks(policy: str) -> None:
    # Same fleet and factor, x's SLO loose: no SLO breaks, and the slowed mu alone still
    # scores GPU 1 higher for z; so the tight case above is moved by the SLO check.
    assert place(policy, 0.5, LOOSE_X_SLO_S)["z"] == (1,)


def test_kvpr_is_not_told_the_factor() -> None:
    def plan(config: PlacementConfig | None) -> PlacementPlan:
        return get_placement_policy("kvpr", config).place(fleet(TIGHT_X_SLO_S), h100s(2))
    assert plan(PlacementConfig(0.5)) == plan(None), "Prism's KVPR has no compute term"


def _sized(x_slo_s: float) -> dict[str, Replica]:
    demands = {d.name: d for d in fleet(x_slo_s)}
    return {name: make_replicas(demands[name], size_model(demands[name], 2))[0]
            for name in ("x", "y", "z")}


def _state_with(replicas: dict[str, Replica], *names: str) -> ClusterState:
    state = ClusterState(h100s(2))
    for name in names:
        state.add(replicas[name], (0,), 0.0)
    return state


def _expected_busy(replica: Replica) -> float:
    """rate / capacity at the sized batch, computed here from the profile's decode rate."""
    profile = replica.demand.profile
    tokens_per_s = profile.throughput_tokens_per_s(replica.point.batch_size)
    capacity_s = tokens_per_s / profile.workload.output_tokens
    return min(1.0, replica.point.rate_per_replica_s / capacity_s)


def test_busy_fraction_is_rate_over_capacity_at_the_sized_batch() -> None:
    replicas = _sized(TIGHT_X_SLO_S)
    colocation = Colocation(0.5)
    assert replicas["x"].point.batch_size == 8, "x is sized at batch 8 (5.57 req/s)"
    assert colocation.busy_fraction(replicas["x"]) == pytest.approx(4.0 / 5.5666, rel=1e-3)
    for name in ("x", "y", "z"):
        assert colocation.busy_fraction(replicas[name]) == pytest.approx(
            _expected_busy(replicas[name])), f"{name}: rate / capacity(sized batch)"
    overloaded = ModelDemand("hot", PROFILES["llama-3.1-8b--fp8--h100"], 500.0, 10.0)
    hot = make_replicas(overloaded, point_for(overloaded, 1))[0]
    assert not hot.point.meets_slo, "a fallback point: the largest batch cannot carry 500/s"
    assert colocation.busy_fraction(hot) == 1.0, "an overloaded neighbour is busy at most always"


def test_expected_load_admits_a_neighbour_the_worst_case_would_not() -> None:
    replicas = _sized(TIGHT_X_SLO_S)
    colocation = Colocation(0.5)
    state = _state_with(replicas, "x")
    assert colocation.candidate(state, replicas["y"], (0,)).keeps_slos, \
        "y busy 59% of the time slows x by 1.30: batch 8 still carries 4 req/s"
    assert not colocation.feasible(replicas["x"], colocation.slowdown(1.0)), \
        "with y counted as always busy (x1.5) x would have no batch within 0.3 s"


def test_candidate_flags_the_resident_it_would_break() -> None:
    replicas = _sized(TIGHT_X_SLO_S)
    colocation = Colocation(0.5)
    state = _state_with(replicas, "x", "y")
    z = replicas["z"]
    assert not colocation.candidate(state, z, (0,)).keeps_slos, "x breaks at load y + z"
    assert colocation.candidate(state, z, (1,)).keeps_slos, "z alone on GPU 1 breaks nothing"
    loose = _sized(LOOSE_X_SLO_S)
    assert colocation.candidate(_state_with(loose, "x", "y"), loose["z"], (0,)).keeps_slos


def test_candidate_divides_each_members_mu_by_its_expected_slowdown() -> None:
    replicas = _sized(TIGHT_X_SLO_S)
    state = _state_with(replicas, "x", "y")
    z = replicas["z"]
    members = Colocation(0.5).candidate(state, z, (0,)).members
    u = {name: _expected_busy(r) for name, r in replicas.items()}
    # Each member's load is the sum of the other two's busy fractions (x 0.72, y 0.59, z 0.54).
    slowdowns = [1 + 0.5 * (u["y"] + u["z"]), 1 + 0.5 * (u["x"] + u["z"]),
                 1 + 0.5 * (u["x"] + u["y"])]
    alone = [*state.group_residents((0,)), z.resident]
    assert [m.key for m in members] == [m.key for m in alone]
    assert [m.mu for m in members] == pytest.approx(
        [m.mu / s for m, s in zip(alone, slowdowns, strict=True)])
    single = Colocation(0.5).candidate(state, z, (1,)).members
    assert single[0].mu == z.resident.mu, "no neighbours: mu unchanged"


def test_factor_zero_leaves_every_member_unslowed() -> None:
    replicas = _sized(TIGHT_X_SLO_S)
    state = _state_with(replicas, "x", "y")
    candidate = Colocation(0.0).candidate(state, replicas["z"], (0,))
    assert candidate.keeps_slos, "f = 0: every candidate keeps its SLOs"
    assert [m.mu for m in candidate.members] == \
        [m.mu for m in [*state.group_residents((0,)), replicas["z"].resident]]

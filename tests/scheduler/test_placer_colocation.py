"""The MME placer told what co-location costs (`PlacementConfig.interference_per_neighbor`).

Issue 7's fig10 gap: Algorithm 1 scores memory only and stacked three replicas on one GPU,
whose steps then ran 1.4x-1.6x slower in the simulator. Told the factor f, the placer divides
each member's mu by 1 + f * neighbours and keeps a replica off a GPU where a resident would
lose its last operating point within its TTFT SLO; told 0 it is the paper's Algorithm 1.

The fleet used below, on 2 H100s, f = 0.5 (profiles: 1,024-token prompts):

    big  Llama-3.1-70B AWQ   0.5 req/s, SLO 5 s     placed first (largest F_M), GPU 0
    x    Llama-3.1-8B FP8    4 req/s,   SLO 0.45 s  alone: batch 8 (5.57 req/s, TTFT 0.115 s)
                                                    1 neighbour (x1.5): batch 16, 0.35 s: ok
                                                    2 neighbours (x2): batch 16, 0.46 s: broken
    y    Llama-3.1-8B AWQ    4 req/s,   SLO 2 s     fine with any neighbour count here
    z    Llama-3-8B QoQ      1 req/s,   SLO 2 s     placed last; memory scores want GPU 1
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
from fineslab.scheduler.placement.sizing import size_model
from fineslab.scheduler.placement.state import ClusterState, Replica, make_replicas
from placer_support import PROFILES, h100s

from fineslab.errors import ConfigError

TIGHT_X_SLO_S = 0.45
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
    assert gpus["x"] == gpus["y"] == (1,), "x and y still share GPU 1"
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


def _state_with_x_and_y_on_gpu0(x_slo_s: float) -> tuple[ClusterState, dict[str, Replica]]:
    demands = {d.name: d for d in fleet(x_slo_s)}
    replicas = {name: make_replicas(demands[name], size_model(demands[name], 2))[0]
                for name in ("x", "y", "z")}
    state = ClusterState(h100s(2))
    state.add(replicas["x"], (0,), 0.0)
    state.add(replicas["y"], (0,), 0.0)
    return state, replicas


def test_candidate_flags_the_resident_it_would_break() -> None:
    state, replicas = _state_with_x_and_y_on_gpu0(TIGHT_X_SLO_S)
    colocation = Colocation(0.5)
    z = replicas["z"]
    assert not colocation.candidate(state, z, (0,)).keeps_slos, "x breaks with 2 neighbours"
    assert colocation.candidate(state, z, (1,)).keeps_slos, "z alone on GPU 1 breaks nothing"
    loose_state, loose = _state_with_x_and_y_on_gpu0(LOOSE_X_SLO_S)
    assert colocation.candidate(loose_state, loose["z"], (0,)).keeps_slos


def test_candidate_divides_each_members_mu_by_its_slowdown() -> None:
    state, replicas = _state_with_x_and_y_on_gpu0(TIGHT_X_SLO_S)
    z = replicas["z"]
    members = Colocation(0.5).candidate(state, z, (0,)).members
    # x, y and z each have 2 neighbours after: slowdown 1 + 0.5 * 2 = 2.
    alone = [*state.group_residents((0,)), z.resident]
    assert [m.key for m in members] == [m.key for m in alone]
    assert [m.mu for m in members] == pytest.approx([m.mu / 2 for m in alone])
    single = Colocation(0.5).candidate(state, z, (1,)).members
    assert single[0].mu == z.resident.mu, "no neighbours: mu unchanged"

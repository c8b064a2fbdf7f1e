"""Global placer: hand-checked scores, the paper's Table 4 scenario, TP, DP, unplaceable models,
and properties over random fleets (memory never exceeded; every model accounted for)."""

from __future__ import annotations

import json

import pytest
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.placement import (
    PLACEMENT_POLICIES,
    ModelDemand,
    PlacementPlan,
    get_placement_policy,
)
from fineslab.scheduler.placement.scoring import Resident, exact_score, proxy_score, water_fill
from hypothesis import given, settings
from hypothesis import strategies as st
from placer_support import GIB, H100_USABLE_BYTES, PROFILES, demand_st, h100s


def resident(key: str, points: list[list[float]], kv_base: float = 0.0) -> Resident:
    return Resident(key, key, 1, 0, kv_base, PiecewiseLinear.from_points(points))


# m1: 0.1 tokens/s per byte for 100 bytes, then 0.05 for 100 more; m2: 0.2 for 100 bytes.
M1 = resident("m1", [[0, 0], [100, 10], [200, 15]])
M2 = resident("m2", [[0, 0], [100, 20]])


def test_proxy_score_by_hand() -> None:
    # K_rem = 100, |G'| = 2, slopes at the base KV: mu1 = 0.1, mu2 = 0.2;
    # eq 3: (0.1 + 0.2) * 100 / 2 = 15.
    assert proxy_score([M1, M2], 100) == pytest.approx(15.0)


def test_exact_score_water_fills_by_hand() -> None:
    # Segments by slope: m2 (0.2, 100), m1 (0.1, 100), m1 (0.05, 100).
    # Budget 100 -> all on m2: 20. Budget 250 -> 20 + 10 + 50 * 0.05 = 32.5.
    assert exact_score([M1, M2], 100) == pytest.approx(20.0)
    gain, alloc = water_fill([M1, M2], 250)
    assert gain == pytest.approx(32.5)
    assert alloc == pytest.approx({"m1": 150.0, "m2": 100.0})


def test_curve_starts_at_the_base_kv() -> None:
    # m1 with 100 bytes of base KV already charged: only the 0.05 segment is left.
    assert exact_score([resident("m", [[0, 0], [100, 10], [200, 15]], 100.0)], 500) == \
        pytest.approx(5.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1000), min_size=2, max_size=6), min_size=1, max_size=4),
       st.floats(0, 5000))
def test_water_filling_beats_an_equal_split(curves: list[list[float]], budget: float) -> None:
    members = [resident(f"m{i}", [[100 * j, sum(ys[:j + 1])] for j in range(len(ys))])
               for i, ys in enumerate(curves)]
    share = budget / len(members)
    equal = sum(m.tokens_per_s(share) - m.tokens_per_s(0) for m in members)
    assert exact_score(members, budget) >= equal - 1e-6, "water-filling is not optimal"


def table4(policy: str) -> PlacementPlan:
    """Table 4: A = Llama-3.1-8B FP16, B = Llama-3.1-8B FP8, C = Llama-3.1-70B AWQ, 2 H100s."""
    gpus = h100s(2)
    models = [ModelDemand("A", PROFILES["llama-3.1-8b--fp16--h100"], 4.0, 2.0),
              ModelDemand("B", PROFILES["llama-3.1-8b--fp8--h100"], 5.0, 2.0),
              ModelDemand("C", PROFILES["llama-3.1-70b--awq--h100"], 1.0, 2.0)]
    return get_placement_policy(policy).place(models, gpus)


@pytest.mark.parametrize("policy", ["mme", "mme-exact", "static"])
def test_table4_fineserve_puts_c_alone_and_pairs_a_with_b(policy: str) -> None:
    plan = table4(policy)
    assert [r.model for r in plan.replicas] == ["C", "A", "B"], "placement order is F_M desc"
    assert {r.model: r.gpu_ids for r in plan.replicas} == {"C": (0,), "A": (1,), "B": (1,)}


def test_table4_kvpr_pairs_c_with_b() -> None:
    plan = table4("kvpr")
    assert [r.model for r in plan.replicas] == ["B", "A", "C"], "order is SLO-weighted rate"
    assert {r.model: r.gpu_ids for r in plan.replicas} == {"B": (0,), "A": (1,), "C": (0,)}


def test_static_partitions_split_memory_by_footprint() -> None:
    plan = table4("static")
    on_gpu1 = plan.replicas_on(1)
    total_fixed = sum(r.fixed_bytes for r in on_gpu1)
    for r in on_gpu1:
        assert r.partition_bytes == H100_USABLE_BYTES * r.fixed_bytes // total_fixed
        assert r.contested_share_bytes == r.partition_bytes - r.fixed_bytes


def test_tp_model_takes_an_aligned_group() -> None:
    gpus = h100s(8)
    models = [ModelDemand("big", PROFILES["llama-3.1-70b--fp16--h100"], 1.0, 5.0),
              ModelDemand("small", PROFILES["llama-3.1-8b--fp8--h100"], 1.0, 5.0)]
    plan = get_placement_policy("mme").place(models, gpus)
    assert plan.gpus_of("big") == [(0, 1, 2, 3)]
    # With the proxy the 8B model prefers an empty GPU: (mu_big + mu_small) / 2 * K_rem on GPU 0
    # is well below mu_small * K_rem on GPU 4, whose memory is all contested.
    assert plan.gpus_of("small")[0][0] >= 4


def test_dp_replicas_when_one_cannot_meet_rate_within_slo() -> None:
    # Llama-3.1-8B FP16 at 20 req/s needs 5120 tokens/s: batch 64 (5517 tokens/s), whose
    # 64 x 1024-token prompts take 32 chunks x 55.7 ms = 1.78 s > 0.5 s SLO. Split over DP.
    gpus = h100s(4)
    plan = get_placement_policy("mme").place(
        [ModelDemand("hot", PROFILES["llama-3.1-8b--fp16--h100"], 20.0, 0.5)], gpus)
    groups = plan.gpus_of("hot")
    assert len(groups) > 1 and len(set(groups)) == len(groups), "replicas on distinct GPUs"
    point = plan.replicas[0].operating_point
    assert point.ttft_s <= 0.5 and point.num_replicas == len(groups)


def test_unplaceable_models_come_with_reasons() -> None:
    gpus = h100s(2)
    models = [ModelDemand("tight", PROFILES["llama-3.1-8b--fp16--h100"], 1.0, 0.001),
              ModelDemand("wide", PROFILES["llama-3.1-70b--fp16--h100"], 1.0, 5.0),
              ModelDemand("elsewhere", PROFILES["llama-3.1-8b--fp16--a100"], 1.0, 5.0)]
    plan = get_placement_policy("mme").place(models, gpus, allow_unplaced=True)
    reasons = {u.model: u.reason for u in plan.unplaced}
    assert "no SLO-feasible operating point" in reasons["tight"]
    assert "no group of 4 h100" in reasons["wide"]
    assert "a100" in reasons["elsewhere"]
    assert plan.replicas == ()




@settings(max_examples=40, deadline=None)
@given(st.lists(demand_st, min_size=1, max_size=10), st.integers(1, 8), st.floats(0.3, 0.95),
       st.sampled_from(sorted(PLACEMENT_POLICIES)))
def test_plan_never_exceeds_memory_and_accounts_for_every_model(
        demands: list[tuple[str, float, float]], num_gpus: int, memory_fraction: float,
        policy: str) -> None:
    gpus = h100s(num_gpus, int(memory_fraction * 80 * GIB))
    models = [ModelDemand(f"m{i}", PROFILES[name], rate, slo)
              for i, (name, rate, slo) in enumerate(demands)]
    plan = get_placement_policy(policy).place(models, gpus, allow_unplaced=True)
    for gpu in gpus:
        on_gpu = plan.replicas_on(gpu.gpu_id)
        assert plan.fixed_bytes_on(gpu.gpu_id) <= gpu.memory_bytes, "fixed memory overflows"
        used = sum(r.fixed_bytes + r.contested_share_bytes for r in on_gpu)
        assert used <= gpu.memory_bytes + len(on_gpu), "contested shares overflow"
    placed = {r.model for r in plan.replicas}
    unplaced = {u.model for u in plan.unplaced}
    assert placed | unplaced == {m.name for m in models}, "a model vanished from the plan"
    assert all(u.reason for u in plan.unplaced)


def test_plan_to_dict_is_json_ready() -> None:
    data = json.loads(json.dumps(table4("static").to_dict()))
    assert [r["model"] for r in data["replicas"]] == ["C", "A", "B"]
    assert data["replicas"][0]["gpu_ids"] == [0]
    assert data["replicas"][1]["partition_bytes"] > data["replicas"][1]["fixed_bytes"]


def test_plan_table_lists_every_replica() -> None:
    text = table4("mme").table()
    assert "placement by mme" in text and all(f"  {m}  " in text for m in "ABC")

"""Oneiros policy (scheduler/oneiros.py): hand-computed cases for every rule.

The device of most tests (layer bytes 100, T_T 1 ms, 8 layers each, cap 3):

    a  inactive, priority 0, used at t=5        c  inactive, priority 1, used at t=9
    b  inactive, priority 0, used at t=7        x  active,   priority 0, used at t=10
"""

from __future__ import annotations

import pytest
from fineslab.scheduler.oneiros import (
    SYNC_COPY_SHARE,
    LendingLedger,
    ModelState,
    cap_for,
    evenly_spaced,
    next_even_layer,
    plan_lending,
    plan_reversion,
    streaming,
)

from fineslab.errors import ConfigError

T_T = {"a": 0.001, "b": 0.001, "c": 0.001, "x": 0.001}


def _m(name: str, priority: int, used_s: float, active: bool = False, cap: int = 3,
       lent: frozenset[int] = frozenset()) -> ModelState:
    return ModelState(name, priority, used_s, active, 8, 100, lent, cap)


def _device() -> list[ModelState]:
    return [_m("a", 0, 5.0), _m("b", 0, 7.0), _m("c", 1, 9.0), _m("x", 0, 10.0, active=True)]


def test_round_robin_within_a_rank_starts_with_the_most_recently_used() -> None:
    plan = plan_lending(_device(), 300, T_T)
    # b (t=7) before a (t=5), one layer each in turn: b, a, b.
    assert [name for name, _ in plan.order] == ["b", "a", "b"]
    assert plan.layers == {"b": (0, 4), "a": (0,)}, "each model's first layers: 0, then 4"
    assert plan.lent_bytes == 300 and plan.met


def test_lower_priority_lends_only_after_the_rank_before_it_reached_its_caps() -> None:
    plan = plan_lending(_device(), 700, T_T)
    names = [name for name, _ in plan.order]
    assert names[:6] == ["b", "a"] * 3, "priority 0 first, round-robin to both caps of 3"
    assert names[6:] == ["c"], "then the priority-1 model"


def test_the_cap_holds_and_an_active_model_lends_nothing_without_a_step_time() -> None:
    plan = plan_lending(_device(), 10_000, T_T)
    assert plan.layers == {"a": (0, 2, 5), "b": (0, 2, 5), "c": (0, 2, 5)}, "3 of 8 each"
    assert not plan.met and plan.lent_bytes == 900, "9 layers of 100 B, short of 10000"


def test_a_cap_of_the_whole_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="never lent whole"):
        ModelState("m", 0, 0.0, False, 8, 100, frozenset(), cap=8)
    assert cap_for(8, 0.001, 1.0) == 7, "a long prefill would hide all 8: still 7 at most"
    assert cap_for(40, 0.002, 0.011) == 5, "T_T * N <= T_compute: floor(11 / 2)"


def test_an_active_model_lends_only_while_its_copies_hide_under_its_step_compute() -> None:
    # Its step computes 4 ms over 8 layers (T_c 0.5 ms), T_T 1 ms. alpha = 2: beta = 2 copies
    # (2 + 2) * 1 ms = 4 ms, hidden; alpha = 3: (3 + 2) * 1 = 5 ms > 4 ms. So 2 of its cap of 3.
    plan = plan_lending(_device(), 10_000, T_T, {"x": 0.004})
    assert plan.layers["x"] == (0, 4)
    assert plan.order[-2:] == (("x", 0), ("x", 4)), "the active model lends last"
    assert streaming(8, 2, 0.001, 0.004).step_s == 0.004, "what it lent hides"


def test_regression_active_bound_counted_alpha_but_a_step_streams_alpha_plus_beta() -> None:
    # Bug: the bound T_T * alpha <= T_compute let x lend 2 layers under a 2.5 ms step, and
    # each of its steps then took (2 + 2) * 1 ms = 4 ms: active lending slowed decode 1.6x.
    plan = plan_lending(_device(), 10_000, T_T, {"x": 0.0025})
    assert "x" not in plan.layers, "no lent layer of the active model may lengthen its step"
    for alpha in range(1, 4):
        lent = plan_lending(_device(), 10_000, T_T, {"x": 0.001 * (alpha + 2)})
        got = len(lent.layers.get("x", ()))
        assert streaming(8, got, 0.001, 0.001 * (alpha + 2)).step_s == 0.001 * (alpha + 2), \
            "whatever the active model lends, its step stays its compute"


def test_without_overlap_an_active_model_lends_while_its_copies_take_a_tenth_of_its_step(
        ) -> None:
    # Copies that cannot overlap compute (the CPU streamer): a 25 ms decode pass may take
    # 0.1 * 25 = 2.5 ms of copies, two layers of 1 ms; the overlapping rule, under the same
    # step, would let it lend its whole cap of 3 ((3 + 2) * 1 ms = 5 ms < 25 ms).
    assert SYNC_COPY_SHARE == 0.1
    plan = plan_lending(_device(), 10_000, T_T, {"x": 0.025}, copies_overlap=False)
    assert plan.layers["x"] == (0, 4), "2 layers: 2 ms of copies <= 2.5 ms, 3 would be 3 ms"
    overlapping = plan_lending(_device(), 10_000, T_T, {"x": 0.025})
    assert len(overlapping.layers["x"]) == 3, "control: with overlap the cap binds instead"
    short = plan_lending(_device(), 10_000, T_T, {"x": 0.009}, copies_overlap=False)
    assert "x" not in short.layers, "a 9 ms pass hides no 1 ms copy within its tenth"
    assert plan_lending(_device(), 10_000, T_T, None, copies_overlap=False).layers.keys() \
        == {"a", "b", "c"}, "no decode timing: the active model lends nothing"


def test_an_unbounded_active_model_lends_up_to_its_cap_whatever_its_copies_cost() -> None:
    # fineslab.fleet.layer_lending's stalled fleet: the bound is lifted for the active model only.
    short = plan_lending(_device(), 10_000, T_T, {"x": 0.009}, copies_overlap=False,
                         unbounded={"x"})
    assert short.layers["x"] == (0, 2, 5), "its cap of 3, though no copy fits a 9 ms pass"
    untimed = plan_lending(_device(), 10_000, T_T, None, copies_overlap=False, unbounded={"x"})
    assert len(untimed.layers["x"]) == 3, "nor is a decode timing needed"
    assert "x" not in plan_lending(_device(), 10_000, T_T, {"x": 0.009},
                                   copies_overlap=False).layers, "control: bounded, none"


def test_layers_are_evenly_spaced_on_the_circle() -> None:
    assert evenly_spaced(8, 2) == (0, 4), "the paper's Figure 7: layers 1 and 5 of 8 (1-based)"
    assert evenly_spaced(8, 4) == (0, 2, 4, 6)
    assert evenly_spaced(40, 4) == (0, 10, 20, 30)
    assert evenly_spaced(6, 3) == (0, 2, 4)
    assert evenly_spaced(8, 3) == (0, 2, 5), "floor(i * 8 / 3): gaps 2, 3, 3"


def test_evenly_spaced_keeps_the_layers_already_lent() -> None:
    # 3 already lent in 8: the farthest from it is 7 (distance 4), then 1 or 5 (distance 2).
    assert next_even_layer(8, {3}) == 7
    assert evenly_spaced(8, 3, keep={3}) == (1, 3, 7)
    plan = plan_lending([_m("a", 0, 0.0, lent=frozenset({3}))], 100, T_T)
    assert plan.layers == {"a": (7,)}, "the new layer goes opposite the lent one"


def test_beta_follows_equations_4_and_5() -> None:
    # n = 40, T_c = 1 ms (step compute 40 ms), T_T = 3 ms.
    # alpha = 9: eq 4: 3 * 10 = 30 <= 1 * (40 - 10) = 30 holds: beta 1, the copies hide.
    nine = streaming(40, 9, 0.003, 0.040)
    assert nine.beta == 1 and nine.step_s == pytest.approx(0.040)
    # alpha = 10: eq 4: 33 > 29 fails; eq 5: 3 * 12 = 36 <= 40 holds: beta 2, still hidden.
    ten = streaming(40, 10, 0.003, 0.040)
    assert ten.beta == 2 and ten.step_s == pytest.approx(0.040)
    # alpha = 20: both fail; beta 1 chain 21 * 4 = 84 ms, beta 2 chain 22 * 3 = 66 ms.
    twenty = streaming(40, 20, 0.003, 0.040)
    assert twenty.beta == 2 and twenty.step_s == pytest.approx(0.066)
    assert streaming(40, 0, 0.003, 0.040).step_s == 0.040, "nothing lent: compute alone"


def test_reversion_undoes_the_latest_lending_first_and_only_whole_layers() -> None:
    order = (("b", 0), ("a", 0), ("b", 4), ("c", 0))
    sizes = {"a": 100, "b": 100, "c": 300}
    assert plan_reversion(order, sizes, 250) == (), "c's 300 B layer is the last: not empty"
    assert plan_reversion(order, sizes, 450) == (("c", 0), ("b", 4))
    assert plan_reversion(order, sizes, 10_000) == tuple(reversed(order))


def test_the_ledger_applies_plans_and_reverts_in_reverse_order() -> None:
    ledger = LendingLedger()
    ledger.apply(plan_lending(_device(), 300, T_T))
    assert ledger.lent_of("b") == {0, 4}
    models = ledger.with_lent(_device())
    assert plan_lending(models, 100, T_T).order == (("b", 2),), \
        "each plan starts its round-robin at the MRU model: b, its third layer between 0 and 4"
    with pytest.raises(ConfigError, match="latest lending first"):
        ledger.revert([("b", 0)])
    ledger.revert(plan_reversion(ledger.order, {"a": 100, "b": 100}, 200))
    assert ledger.order == [("b", 0)]

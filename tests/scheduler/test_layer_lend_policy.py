"""Oneiros' lending loop as a policy (scheduler/oneiros.LayerLendPolicy): a device snapshot in,
a decision with its reason out, the thresholds its configuration. The loop that applies it,
with real stream-state files: tests/serving/test_lending.py."""

from __future__ import annotations

import dataclasses

import pytest
from fineslab.scheduler.oneiros import DeviceLending, LayerLendConfig, LayerLendPolicy, LenderView

from fineslab.errors import ConfigError

SLAB = 1 << 20
NUM_SLABS = 40
LAYER = 2 * SLAB


def _view(pressed: bool = True, free_slabs: int = 0, stalled: bool = False, now_s: float = 0.0,
          **runtimes: LenderView) -> DeviceLending:
    return DeviceLending("cpu", pressed, stalled, free_slabs * SLAB, NUM_SLABS, SLAB,
                         tuple(runtimes.values()), now_s)


def _idle(name: str, cap: int | None = 2) -> LenderView:
    return LenderView(name, 0, cap, False, 4, LAYER)


def test_a_layer_is_lent_only_once_the_device_was_pressed_for_the_configured_rounds() -> None:
    policy = LayerLendPolicy()
    first = policy.decide(_view(a=_idle("a")))
    assert first.lend == () and "waiting for the reclaimer" in first.reason
    second = policy.decide(_view(a=_idle("a")))
    assert second.lend == (("a", 0), ("a", 2)) and "pressed for 2 rounds" in second.reason
    assert policy.ledger("cpu").lent_of("a") == {0, 2}
    eager = LayerLendPolicy(LayerLendConfig(pressed_rounds=1))
    assert eager.decide(_view(a=_idle("a"))).lend == (("a", 0), ("a", 2)), \
        "the threshold is configuration"


def test_the_latest_lent_layer_comes_back_above_the_configured_low_water_mark() -> None:
    for fraction, room_slabs in ((0.1, 6), (0.0, 2)):
        policy = LayerLendPolicy(LayerLendConfig(pressed_rounds=1, low_free_fraction=fraction))
        policy.decide(_view(a=_idle("a")))
        short = policy.decide(_view(pressed=False, free_slabs=room_slabs - 1, a=_idle("a")))
        assert short.revert == () and "no room" in short.reason
        back = policy.decide(_view(pressed=False, free_slabs=room_slabs, a=_idle("a")))
        assert back.revert == (("a", 2),), (fraction, back)
        assert policy.ledger("cpu").lent_of("a") == {0}


def test_an_active_model_beyond_its_bound_lends_only_after_the_stall_and_says_so() -> None:
    busy = LenderView("busy", 0, 2, True, 4, LAYER, copy_s=0.001, decode_compute_s=0.009,
                      decode_passes=3)
    policy = LayerLendPolicy(LayerLendConfig(pressed_rounds=1, starved_rounds=2))
    assert policy.decide(_view(busy=busy)).lend == (), "a 1 ms copy does not fit 0.9 ms"
    assert policy.decide(_view(stalled=True, busy=busy)).lend == (), "stalled for one round"
    decision = policy.decide(_view(stalled=True, busy=busy))
    assert decision.lend == (("busy", 0), ("busy", 2))
    assert decision.warnings and "busy lends beyond its bound" in decision.warnings[0]
    assert "lends while active" in decision.notes[0]


def test_the_ledger_follows_a_runtime_that_refused() -> None:
    policy = LayerLendPolicy(LayerLendConfig(pressed_rounds=1))
    policy.decide(_view(a=_idle("a")))
    assert policy.follow("cpu", "a", [0]) and policy.ledger("cpu").lent_of("a") == {0}
    assert not policy.follow("cpu", "a", [0]), "nothing to follow the second time"


@pytest.mark.parametrize("field, value", [("interval_s", 0.0), ("pressed_rounds", 0),
                                          ("starved_rounds", 0), ("host_link_bytes_s", -1.0),
                                          ("low_free_fraction", 1.0)])
def test_thresholds_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match="layer lending thresholds"):
        dataclasses.replace(LayerLendConfig(), **{field: value})

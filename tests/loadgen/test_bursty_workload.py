"""Bursty groups (fineslab.workload.bursty): a shifting third of the models active at a time."""

from __future__ import annotations

import pytest

from fineslab.errors import ConfigError
from fineslab.workload import SHAREGPT_STATS
from fineslab.workload.bursty import BurstySpec, bursty_workload

MODELS = tuple(f"m{i}" for i in range(9))


def _spec(**overrides: object) -> BurstySpec:
    fields: dict[str, object] = dict(models=MODELS, rate_per_s=4.0, active_fraction=1 / 3,
                                     switch_mean_s=10.0, duration_s=200.0,
                                     lengths_path=SHAREGPT_STATS, seed=0)
    fields.update(overrides)
    return BurstySpec(**fields)  # type: ignore[arg-type]


def test_only_the_active_group_gets_requests_in_each_period() -> None:
    requests, periods = bursty_workload(_spec())
    assert all(len(p.active) == 3 for p in periods), "a third of 9 models"
    assert len(periods) > 5, "the group changes often (mean 10 s over 200 s)"
    for r in requests:
        period = next(p for p in periods if p.start_s <= r.arrival_s < p.end_s)
        assert r.model in period.active, f"{r.request_id} came from an inactive model"
    assert len({p.active for p in periods}) > 1, "the active set shifts"


def test_rate_per_active_model_and_determinism() -> None:
    requests, periods = bursty_workload(_spec(duration_s=600.0))
    active_s = sum((p.end_s - p.start_s) * len(p.active) for p in periods)
    assert len(requests) / active_s == pytest.approx(4.0, rel=0.1)
    again, _ = bursty_workload(_spec(duration_s=600.0))
    assert again == requests, "a pure function of its spec"
    other, _ = bursty_workload(_spec(duration_s=600.0, seed=1))
    assert other != requests
    assert len({r.request_id for r in requests}) == len(requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)


def test_all_active_is_a_steady_mix() -> None:
    requests, periods = bursty_workload(_spec(active_fraction=1.0))
    assert all(set(p.active) == set(MODELS) for p in periods)
    assert {r.model for r in requests} == set(MODELS)


@pytest.mark.parametrize("bad", [dict(active_fraction=0.0), dict(active_fraction=1.5),
                                 dict(rate_per_s=0.0), dict(models=("a", "a")),
                                 dict(models=())])
def test_bad_specs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _spec(**bad)

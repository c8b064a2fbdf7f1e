"""Waiting for the machine to settle before a measurement (`fineslab.bench.settle`)."""

from __future__ import annotations

import logging

import pytest

from fineslab.bench.settle import cpu_busy, wait_settled


def test_the_busy_share_is_the_busy_jiffies_over_all_of_them() -> None:
    readings = iter([(100, 1000), (150, 1100)])
    assert cpu_busy(0.0, times=lambda: next(readings), sleep=lambda _: None) == 0.5
    assert 0.0 <= cpu_busy(0.05) <= 1.0, "this machine's own /proc/stat"


def test_it_waits_until_the_machine_is_quiet() -> None:
    now, busy = [0.0], iter([0.9, 0.8, 0.3, 0.1])

    def reading() -> float:
        now[0] += 1.0
        return next(busy)

    found = wait_settled(30.0, 0.5, reading=reading, clock=lambda: now[0])
    assert found.settled and found.busy == 0.3 and found.waited_s == 3.0
    assert found.figures() == {"cpu_busy_before": 0.3, "settle_wait_s": 3.0, "settled": True}


def test_a_machine_that_stays_busy_is_logged_and_the_measurement_goes_ahead(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]

    def reading() -> float:
        now[0] += 1.0
        return 0.95

    with caplog.at_level(logging.WARNING):
        found = wait_settled(5.0, 0.5, what="a test probe", reading=reading,
                             clock=lambda: now[0])
    assert not found.settled and found.waited_s == 5.0
    assert "95% busy after 5 s; a test probe goes ahead" in caplog.text
    once = wait_settled(0.0, 0.5, reading=lambda: 0.95, clock=lambda: 0.0)
    assert not once.settled, "a limit of 0: one reading"

"""The cache reclaim policy (fineslab.scheduler.reclaim): arena use in, decision out, no I/O.
The loop that applies it against real runtimes: tests/serving/test_cache_reclaim.py."""

from __future__ import annotations

from fineslab.scheduler.reclaim import ArenaUse, CacheReclaimPolicy, ReclaimConfig

RUNTIMES = ("busy", "idle", "idle2")


def _use(free: int, blocks: dict[str, int], demand: dict[str, int]) -> ArenaUse:
    return ArenaUse("cpu", RUNTIMES, free, 56, blocks, demand)


def test_a_pressed_arena_flushes_the_idle_holders_with_the_reason() -> None:
    policy = CacheReclaimPolicy()
    decision = policy.decide(_use(2, {"busy": 40, "idle": 300, "idle2": 0}, {"busy": 1}), 0.0)
    assert decision.pressed and decision.flush == ("idle",)
    assert decision.reason == "busy waiting, the arena on cpu low on free slabs (2 of 56 " \
                              "slabs free)"
    again = policy.decide(_use(2, {"busy": 40, "idle": 300}, {"busy": 1}), 1.0)
    assert again.pressed and again.flush == (), "at most once per min_gap_s"


def test_no_work_waiting_is_no_pressure_however_full() -> None:
    decision = CacheReclaimPolicy().decide(_use(0, {"busy": 40, "idle": 300}, {}), 0.0)
    assert not decision.pressed and decision.flush == () and decision.reason == "not pressed"


def test_the_thresholds_are_the_policys_configuration() -> None:
    # 10 of 56 free: not low under the default 0.1, low under 0.2; a 1 s gap lets it flush
    # again a second later.
    use = _use(10, {"busy": 40, "idle": 300}, {"busy": 1})
    assert not CacheReclaimPolicy().decide(use, 0.0).pressed
    eager = CacheReclaimPolicy(ReclaimConfig(low_free_fraction=0.2, min_gap_s=1.0))
    assert eager.decide(use, 0.0).flush == ("idle",)
    assert eager.decide(use, 1.0).flush == ("idle",)


def test_a_stall_presses_only_while_the_arena_is_short() -> None:
    policy = CacheReclaimPolicy(ReclaimConfig(stall_s=3.0))
    blocks = {"busy": 40, "idle": 300}
    assert policy.decide(_use(20, blocks, {"busy": 1}), 0.0).stalled == ()
    stalled = policy.decide(_use(20, blocks, {"busy": 1}), 3.0)
    assert stalled.stalled == ("busy",) and stalled.pressed and stalled.flush == ("idle",)
    assert "busy stalled" in stalled.reason
    roomy = CacheReclaimPolicy(ReclaimConfig(stall_s=3.0))
    roomy.decide(_use(55, blocks, {"busy": 1}), 0.0)
    decision = roomy.decide(_use(55, blocks, {"busy": 1}), 3.0)
    assert decision.stalled == ("busy",) and not decision.pressed, "mostly free: not memory"


def test_a_restart_may_flush_every_idle_holder_but_itself() -> None:
    policy = CacheReclaimPolicy()
    use = _use(20, {"busy": 40, "idle": 300, "idle2": 8}, {"busy": 1})
    assert policy.flush_all_idle(use, 0.0, exclude="idle2") == ("idle",)
    policy.flushed("idle", 0.0)
    assert policy.decide(_use(2, {"busy": 40, "idle": 300}, {"busy": 1}), 1.0).flush == (), \
        "a restart's flush starts the gap too"

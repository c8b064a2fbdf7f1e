"""Prefix lending in a fleet (issue #20) without SGLang: the config switch, the runtime's command
line and environment, and the launcher's lending round against hand-computed caps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.plan import make_plan
from fineslab.fleet.prefix_lending import BorrowerSpec, PrefixLending
from fineslab.fleet.runtimes import server_spec
from fineslab.quant.serving import PrecisionRuntime
from fineslab.sglang_plugin import ArenaJoin
from fineslab.slabs import ArenaSpec, KVDtype, SlabArena
from fineslab.slabs.lent import lent_slabs
from fineslab.slabs.table import SlabState
from fineslab.slabs.weights import carve_weight_slabs

REPO = Path(__file__).resolve().parents[2]


def _demo() -> dict:
    return yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())


def _error_of(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        fleet_from_dict(data, "test.yaml")
    return str(info.value)


def test_prefix_lending_is_a_model_switch_with_checked_fields() -> None:
    data = _demo()
    data["models"][0]["prefix_lending"] = {"cap": 0.25, "window_s": 5}
    config = fleet_from_dict(data, "test.yaml")
    lending = config.models[0].prefix_lending
    assert lending is not None and (lending.cap, lending.window_s, lending.check_s) == \
        (0.25, 5.0, 1.0)
    assert config.models[1].prefix_lending is None
    for bad, why in [({"cap": 0}, "greater than 0"), ({"cap": 1.5}, "less than or equal to 1"),
                     ({"check_s": 0}, "greater than 0"), ({"share": 1}, "share")]:
        data["models"][1]["prefix_lending"] = bad
        assert why in _error_of(data), bad
    data["models"][1]["prefix_lending"] = {}
    data["models"][1]["extra_args"] = ["--disable-radix-cache"]
    assert "drop ['--disable-radix-cache']" in _error_of(data)
    data["models"][1]["extra_args"] = []
    data["kv_pool"] = "sglang"
    assert "prefix_lending lends the slab arena's free slabs" in _error_of(data)


def test_a_lending_runtime_names_the_lent_backend_and_starts_with_no_slabs() -> None:
    data = _demo()
    data["models"][0]["prefix_lending"] = {}
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    borrower = plan.runtimes_of(data["models"][0]["name"])[0]
    other = plan.runtimes_of(data["models"][1]["name"])[0]
    specs = [server_spec(r, PrecisionRuntime(r.model.name, "bf16", Path(r.model_dir),
                                             KVDtype.BF16, ()), "f", True)
             for r in (borrower, other)]
    args = list(specs[0].extra_args)
    assert args[args.index("--radix-cache-backend") + 1] == "fineslab_lent"
    assert specs[0].env["FINESLAB_PREFIX_LENDING"] == "0"
    assert "--radix-cache-backend" not in specs[1].extra_args
    assert "FINESLAB_PREFIX_LENDING" not in specs[1].env
    join = ArenaJoin.from_env(FineslabEnv.from_environ(specs[0].env))
    assert join is not None and join.prefix_lending == 0, "the tier is on, with no slabs yet"


def test_the_join_reads_the_lending_variable_and_refuses_a_bad_one() -> None:
    env = {"FINESLAB_ARENA": "a", "FINESLAB_RUNTIME_ID": "r"}
    assert ArenaJoin.from_env(FineslabEnv.from_environ(env)).prefix_lending is None
    join = ArenaJoin.from_env(FineslabEnv.from_environ({**env, "FINESLAB_PREFIX_LENDING": "3"}))
    assert join is not None and join.prefix_lending == 3
    assert join.environ()["FINESLAB_PREFIX_LENDING"] == "3"
    with pytest.raises(ConfigError, match="whole number of slabs"):
        FineslabEnv.from_environ({**env, "FINESLAB_PREFIX_LENDING": "half"})


# -- the lending round --------------------------------------------------------------------------
# An arena of 20 slabs of 4 KiB: "chat" borrows, "idle" lends. Cap 0.5 -> 10 slabs; low water
# = LOW_FREE_FRACTION (0.1) x 20 = 2 slabs.

@pytest.fixture
def arena(tmp_path: Path) -> Iterator[SlabArena]:
    spec = ArenaSpec("lend", "cpu0", 20 * 4096, 4096, 8, max_runtimes=8)
    with SlabArena.create(spec, shm_dir=tmp_path) as created:
        yield created


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_round_caps_a_borrower_by_algorithm_1_headroom_and_its_cap(
        arena: SlabArena) -> None:
    table = arena.table
    chat = table.register("chat-r0", 512)
    idle = table.register("idle-r0:w", 4096)
    idle_slabs = carve_weight_slabs(table, idle, 4)  # the lender holds 4 slabs: D = 4
    clock = Clock()
    lending = PrefixLending([BorrowerSpec("chat-r0", "cpu", 0.5, 10.0, 1.0)],
                            {"cpu": ["chat-r0", "idle-r0:w"]}, lambda d: table, clock)
    # t=0: N starts at K = 20, headroom 20 - 4 = 16: free 16 - 16 - low water 2 -> 0
    assert lending.run_once() == {"chat-r0": 0}
    assert int(table.rt_lend_cap[chat]) == 0
    # t=1: a check, N -> max D of the window = 4; headroom 0: min(10, 16 - 2) = 10
    clock.now = 1.0
    assert lending.run_once() == {"chat-r0": 10}
    # the lender bursts to 12 slabs: N jumps at once to 12 (headroom 0); free 8: 8 - 2 = 6
    burst = carve_weight_slabs(table, idle, 8)
    clock.now = 1.5
    assert lending.run_once() == {"chat-r0": 6}
    # it gives the burst back: D = 4, but N stays 12 (the window remembers the burst) until a
    # check after the window: headroom 8, free 16: 16 - 8 - 2 = 6
    for slab in burst.tolist():
        with table.lock():
            table.release_locked(slab)
    clock.now = 2.0
    assert lending.run_once() == {"chat-r0": 6}
    clock.now = 11.6  # the burst's sample (1.5) is still in force at 11.6 - 10 = 1.6
    assert lending.run_once() == {"chat-r0": 6}
    clock.now = 12.6  # in force at 2.6: the sample of 2.0 (D = 4): N -> 4, headroom 0
    assert lending.run_once() == {"chat-r0": 10}
    assert idle_slabs.size == 4


def test_lent_slabs_count_as_the_borrowers_own_when_its_cap_is_computed(
        arena: SlabArena) -> None:
    table = arena.table
    chat = table.register("chat-r0", 512)
    with table.lock():  # the borrower holds 5 lent slabs (FREE, marked)
        lent = np.arange(15, 20)
        table.lent_to[lent] = chat + 1
    assert lent_slabs(table) == {"chat-r0": 5}
    assert (table.state[lent] == SlabState.FREE).all()
    lending = PrefixLending([BorrowerSpec("chat-r0", "cpu", 0.5, 10.0, 1.0)],
                            {"cpu": ["chat-r0"]}, lambda d: table, Clock())
    # no lenders: free unlent 15 (20 - 5 lent), lent 5: min(10, 5 + 15 - 2) = 10
    assert lending.run_once() == {"chat-r0": 10}


def test_the_prefix_example_plans_one_borrower_beside_two_lenders() -> None:
    data = yaml.safe_load((REPO / "examples" / "cpu-prefix.yaml").read_text())
    plan = make_plan(fleet_from_dict(data, "cpu-prefix.yaml"))
    lending = [r.model.name for r in plan.runtimes if r.model.prefix_lending is not None]
    assert lending == ["chat"] and len(plan.runtimes) == 3
    assert len({r.device.name for r in plan.runtimes}) == 1, "one arena: the lenders' memory"


def test_two_borrowers_on_a_device_split_the_free_slabs(arena: SlabArena) -> None:
    table = arena.table
    table.register("a-r0", 512)
    table.register("b-r0", 512)
    lending = PrefixLending([BorrowerSpec(r, "cpu", 1.0, 10.0, 1.0) for r in ("a-r0", "b-r0")],
                            {"cpu": ["a-r0", "b-r0"]}, lambda d: table, Clock())
    # no lenders, 20 free unlent slabs: each borrower min(20, 0 + 20 // 2 - 0 - 2) = 8
    assert lending.run_once() == {"a-r0": 8, "b-r0": 8}

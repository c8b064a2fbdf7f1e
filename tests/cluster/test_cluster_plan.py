"""The global placement over several nodes and each node's share of it (no Ray, no SGLang)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from fineslab.cluster.plan import NodeDevices, make_cluster_plan, place_on_residual
from fineslab.errors import ConfigError
from fineslab.fleet.config import FleetConfig, fleet_from_dict
from fineslab.fleet.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def _demo(**changes: Any) -> FleetConfig:
    data = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())
    data["devices"] = [{"name": "cpu", "kind": "cpu", "memory_gib": 0.5, "kv_arena_mib": 16}]
    data.update(changes)
    return fleet_from_dict(data, "demo", REPO / "examples")


def _nodes(config: FleetConfig, names: tuple[str, ...] = ("a", "b")) -> list[NodeDevices]:
    assert config.devices is not None
    return [NodeDevices(name, config.devices) for name in names]


def test_the_placer_spreads_the_demo_fleet_over_both_nodes_and_each_share_plans_alone() -> None:
    config = _demo()
    plan = make_cluster_plan(config, _nodes(config))
    on_a, on_b = plan.models_on("a"), plan.models_on("b")
    assert on_a and on_b and sorted(on_a + on_b) == sorted(m.name for m in config.models)
    for node, models in (("a", on_a), ("b", on_b)):
        share = plan.node_placement(node)
        assert [g.gpu_id for g in share.gpus] == [0], "a node's GPU ids are its own, from 0"
        assert sorted(r.model for r in share.replicas) == sorted(models)
        node_config = plan.node_config(node)
        assert node_config.cluster is None and node_config.fleet_id == f"{config.fleet_id}-{node}"
        assert [m.name for m in node_config.models] == models
        node_plan = make_plan(node_config, placement=share)  # what the node's launcher does
        assert sorted(r.model.name for r in node_plan.runtimes) == sorted(models)
        assert len(node_plan.arenas) == 1


def test_a_given_placement_over_other_devices_than_the_nodes_is_refused() -> None:
    config = _demo()
    plan = make_cluster_plan(config, _nodes(config))
    two = dataclasses.replace(plan.node_placement("a"), gpus=plan.placement.gpus)
    with pytest.raises(ConfigError, match="over 2 devices, the node has 1"):
        make_plan(plan.node_config("a"), placement=two)


def test_a_lost_nodes_models_go_where_the_survivor_has_room_and_the_rest_are_named() -> None:
    config = _demo()
    plan = make_cluster_plan(config, _nodes(config))
    lost = plan.models_on("b")
    survivor = _nodes(config, ("a",))
    placed, left = place_on_residual(config, survivor, {}, lost, {})
    assert placed is not None and not left
    assert sorted(placed.models_on("a")) == sorted(lost)
    assert placed.node_config("a", generation=1).fleet_id == f"{config.fleet_id}-a-g1"
    # negative control: the survivor's memory taken by what runs there, nothing fits
    full = {("a", "cpu"): int(0.5 * GIB) - 1024}
    placed, left = place_on_residual(config, survivor, full, lost, {})
    assert placed is None and sorted(left) == sorted(lost)


def test_a_replica_may_not_span_nodes() -> None:
    config = _demo()
    plan = make_cluster_plan(config, _nodes(config))
    with pytest.raises(ConfigError, match="spans nodes"):
        plan.node_of((0, 1))


def test_the_cluster_section_is_validated_and_absent_by_default() -> None:
    assert _demo().cluster is None
    config = _demo(cluster={"engine": "ray", "address": "10.0.0.1:6379", "min_nodes": 2})
    assert config.cluster is not None and config.cluster.min_nodes == 2
    with pytest.raises(ConfigError, match=r"cluster\.engine"):
        _demo(cluster={"engine": "k8s"})
    with pytest.raises(ConfigError, match=r"cluster\.min_nodes"):
        _demo(cluster={"min_nodes": 0})
    with pytest.raises(ConfigError, match=r"cluster\.nodes"):
        _demo(cluster={"nodes": 3})


def test_one_machine_never_imports_ray() -> None:
    import subprocess
    import sys

    code = ("import sys; from fineslab.launch.__main__ import main; "
            f"main(['--config', {str(REPO / 'examples' / 'cpu-demo.yaml')!r}, '--dry-run']); "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_gpu_recipe_places_over_two_nodes_of_eight_h100s() -> None:
    """examples/gpu-cluster.yaml with its profiles (no model folder needed to place it)."""
    from fineslab.fleet.config import DeviceConfig, load_fleet_config
    from fineslab.fleet.profiles import find_profile, profile_dirs

    config = load_fleet_config(REPO / "examples" / "gpu-cluster.yaml")
    assert config.cluster is not None and config.cluster.min_nodes == 2
    dirs = profile_dirs(config.profile_dirs)
    profiles = {m.name: find_profile(m, "h100", dirs, None) for m in config.models}
    h100s = tuple(DeviceConfig(name=f"cuda:{i}", kind="h100", memory_gib=80) for i in range(8))
    plan = make_cluster_plan(config, [NodeDevices("n1", h100s), NodeDevices("n2", h100s)],
                             profiles=profiles)
    placed = {r.model.split("#")[0] for r in plan.placement.replicas}
    assert placed == {m.name for m in config.models}
    assert plan.models_on("n1") and plan.models_on("n2"), "both nodes take models"
    assert len({g for r in plan.placement.replicas for g in r.gpu_ids}) > 8, (
        "the recipe's rates need more GPUs than one node has")
    for node in ("n1", "n2"):
        assert {g.gpu_id for g in plan.node_placement(node).gpus} == set(range(8))

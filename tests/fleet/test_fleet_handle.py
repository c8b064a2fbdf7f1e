"""FleetHandle's failure paths with a real launcher that cannot start (no SGLang needed): the
error names why and ends with the launcher's output. Its success path is every launched fleet
of the suite (tests/serving/fleet_support.py, the chaos and prefix benchmarks' tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fineslab.fleet import FleetHandle, FleetStartError

REPO = Path(__file__).resolve().parents[2]


def _demo(fleet_id: str) -> dict[str, object]:
    config = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())
    config["fleet_id"] = fleet_id
    return dict(config)


def test_a_launcher_that_exits_raises_with_its_output(tmp_path: Path) -> None:
    config = _demo(f"bad-{os.getpid()}")
    config["models"] = [{"name": "x", "preset": "llama-tiny"}]  # no SLO, no request rate
    with pytest.raises(FleetStartError, match="exited with status") as info:
        FleetHandle.launch(config, tmp_path, "bad", timeout_s=120)
    assert "ttft_slo_s: Field required" in str(info.value), \
        "the launcher's own message reaches the caller"
    assert (tmp_path / "bad.yaml").exists() and (tmp_path / "bad.out").exists()


def test_a_launcher_not_ready_in_time_is_killed_and_named(tmp_path: Path) -> None:
    config = _demo(f"slow-{os.getpid()}")
    with pytest.raises(FleetStartError, match="not ready after 0 s") as info:
        FleetHandle.launch(config, tmp_path, "slow", timeout_s=0.01)
    assert str(tmp_path / "slow.out") in str(info.value)


def test_the_router_port_is_never_the_configs(tmp_path: Path) -> None:
    """The example's port (8000) may be a running demo's: a handle always takes a free one
    unless told which."""
    config = _demo(f"port-{os.getpid()}")
    with pytest.raises(FleetStartError):
        FleetHandle.launch(config, tmp_path, "p", timeout_s=0.01)
    written = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert written["router"]["port"] != 8000

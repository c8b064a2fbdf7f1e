"""A cluster fleet refuses a bad start at once, before it touches Ray (no Ray, no SGLang)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import yaml

from fineslab.cluster.driver import ClusterFleet
from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.fleet.config import FleetConfig, fleet_from_dict

REPO = Path(__file__).resolve().parents[2]


def _config(**router: object) -> FleetConfig:
    data = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())
    data["router"].update(router)
    data["cluster"] = {"address": "127.0.0.1:1"}  # nothing listens there
    return fleet_from_dict(data, "demo", REPO / "examples")


def test_a_busy_front_port_fails_the_start_before_ray_is_contacted() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        fleet = ClusterFleet(_config(port=port))
        with pytest.raises(EnvironmentSetupError, match=f"port {port} on 127.0.0.1 is in use"):
            fleet.start()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_an_api_key_variable_that_is_not_set_is_a_config_error(monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    monkeypatch.delenv("FINESLAB_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="FINESLAB_TEST_NO_SUCH_KEY, which is not set"):
        ClusterFleet(_config(api_key_env="FINESLAB_TEST_NO_SUCH_KEY"))

"""A launched fleet's runtimes are forks of its zygote, and the zygote is supervised: killed,
it is replaced at once, and a runtime's next restart is a fork of the new one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from fleet_support import launched

from fineslab.fleet import fleet_processes

# The launcher's own zygote, as a user's fleet has (not the suite's: conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_zygote")]


def _zygotes(fleet_id: str) -> list[int]:
    return [pid for pid in fleet_processes(fleet_id)
            if b"fineslab.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_zygote_is_replaced_and_the_next_restart_forks_from_the_new_one(
        tmp_path: Path, model_cache: Path) -> None:
    fleet_id = f"warm-{os.getpid()}"
    with launched("cpu-demo.yaml", tmp_path, model_cache, fleet_id, signal.SIGINT,
                  edit=lambda c: c.update(models=c["models"][:1])) as (fleet, _):
        runtime, wrapper = next(iter(fleet.runtime_pids().items()))
        [zygote] = _zygotes(fleet_id)
        assert _parent(wrapper) == zygote, "the runtime is a fork of the fleet's zygote"
        os.kill(zygote, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while not [z for z in _zygotes(fleet_id) if z != zygote]:
            assert time.monotonic() < deadline, "the zygote was not replaced"
            time.sleep(0.5)
        assert fleet.health()["status"] == "ok", "the runtime served on without its zygote"
        os.killpg(wrapper, signal.SIGKILL)
        while fleet.runtime_pids().get(runtime) == wrapper or fleet.health()["status"] != "ok":
            assert time.monotonic() < deadline, "the killed runtime never came back"
            time.sleep(0.5)
        # The replacement, found once settled: a zygote's first process exits at once (it
        # leaves the launcher's tree) and showed as a second one in a run of the suite.
        revived = [z for z in _zygotes(fleet_id) if z != zygote]
        assert _parent(fleet.runtime_pids()[runtime]) in revived, \
            f"the restart forked from the replacement zygote ({revived})"
    assert not fleet_processes(fleet_id), "nothing of the fleet, zygote included, is left"

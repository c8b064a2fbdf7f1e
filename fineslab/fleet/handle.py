"""One launched fleet: `python -m fineslab.launch` in a session of its own, seen from outside.

    fleet = FleetHandle.launch(config, folder, progress=print)   # returns once it is ready
    httpx.post(fleet.base_url + "/v1/completions", json=...)
    fleet.stop()                                                  # Ctrl-C, then SIGKILL
    assert not fleet.leftovers()                                  # processes, arena, shm files

The launcher runs with `--stop-with-fd` by default: the fleet stops when the process holding
the handle dies, even by kill -9 (fineslab.lifeline). What is left of a fleet is found the way
the launcher's own sweep finds it: processes whose environment carries the fleet's marker
(`FINESLAB_FLEET_ID`; runtimes forked from a zygote keep it, fineslab.zygote), the fleet's
arena files, and the SGLang shm files its run record names.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from fineslab.errors import EnvironmentSetupError
from fineslab.lifeline import remove_dead_fleet_files
from fineslab.proctree import fleet_processes, stop_group
from fineslab.runtime import free_port, lifeline_read_fd
from fineslab.slabs.shm import default_shm_dir

#: How long a fleet may take to be ready (a four-precision fleet writes its checkpoints first).
READY_TIMEOUT_S = 900.0


class FleetStartError(EnvironmentSetupError):
    """The launcher exited or was not ready in time; the message ends with its output."""


def leftover_files(fleet_id: str, sglang_files: list[str]) -> list[str]:
    """The fleet's arena files and the given SGLang shm files that still exist."""
    arenas = [str(p) for p in default_shm_dir().glob(f"fineslab-{fleet_id}-*")]
    return arenas + [f for f in sglang_files if Path(f).exists()]


@dataclass(frozen=True)
class Leftovers:
    """What is left of a stopped fleet (falsy when nothing)."""

    processes: list[int]
    files: list[str]

    def __bool__(self) -> bool:
        return bool(self.processes or self.files)


H = TypeVar("H", bound="FleetHandle")


class FleetHandle:
    """A fleet launched in a process of its own (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, fleet_id: str,
                 models: list[str], output: Path) -> None:
        self.proc = proc
        self.base_url = base_url
        self.fleet_id = fleet_id
        self.models = models
        self.output = output
        self.ready_s: float | None = None
        self._relayed = 0
        self._started_s = time.monotonic()

    @classmethod
    def launch(cls: type[H], config: Mapping[str, Any], folder: Path, name: str = "fleet", *,
               port: int | None = None, env: Mapping[str, str] | None = None,
               cwd: Path | None = None,
               log_dir: Path | None = None, own_log_dir: bool = False,
               stop_with_this_process: bool = True,
               timeout_s: float = READY_TIMEOUT_S,
               progress: Callable[[str], None] | None = None) -> H:
        """Write `config` (its router on `port`, default a free one) to `folder/<name>.yaml`,
        start the launcher and wait until it is ready; FleetStartError if it is not.
        Runtime logs go to `log_dir` (default `folder/<name>-logs`), or with `own_log_dir`
        to the launcher's own temporary folder (kept only if something went wrong)."""
        router = dict(config.get("router", {}))
        router["port"] = port or free_port()  # never the config's: a running fleet may hold it
        config = {**config, "router": router}
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(dict(config)))
        output = folder / f"{name}.out"
        argv = [sys.executable, "-m", "fineslab.launch", "--config", str(path)]
        if not own_log_dir:
            argv += ["--log-dir", str(log_dir or folder / f"{name}-logs")]
        pass_fds: tuple[int, ...] = ()
        if stop_with_this_process:
            argv += ["--stop-with-fd", str(lifeline_read_fd())]
            pass_fds = (lifeline_read_fd(),)
        with open(output, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    env=None if env is None else dict(env), cwd=cwd,
                                    start_new_session=True, pass_fds=pass_fds)
        fleet = cls(proc, f"http://127.0.0.1:{router['port']}", str(config["fleet_id"]),
                    [str(m["name"]) for m in config["models"]], output)
        try:
            fleet.wait_ready(timeout_s, progress)
        except BaseException:  # Ctrl-C in a notebook, a progress callback's error: no fleet left
            fleet.cleanup()
            raise
        return fleet

    # -- start ----------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S,
                   progress: Callable[[str], None] | None = None) -> float:
        """Block until the launcher prints `ready`, passing its progress lines to `progress`;
        the seconds since the launch. Kills the fleet and raises FleetStartError if the
        launcher exits first or `timeout_s` passes."""
        deadline = self._started_s + timeout_s
        while True:
            text = self.output.read_bytes()
            if progress is not None:
                self._relay(text, progress)
            if b"\nready\n" in text or text.startswith(b"ready\n"):
                self.ready_s = time.monotonic() - self._started_s
                return self.ready_s
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = ("exited with status " + str(self.proc.returncode)
                       if self.proc.poll() is not None else f"not ready after {timeout_s:.0f} s")
                self.kill()
                raise FleetStartError(f"fleet {self.fleet_id} {why}; the launcher's output "
                                      f"({self.output}) ends:\n{self.output_tail()}")
            time.sleep(0.5)

    def _relay(self, text: bytes, progress: Callable[[str], None]) -> None:
        whole = text[:text.rfind(b"\n") + 1]
        for line in whole[self._relayed:].decode(errors="replace").splitlines():
            if line and not line.startswith(("20", "[20")):  # timestamped: a log, not progress
                progress(line)
        self._relayed = len(whole)

    def output_tail(self, num_chars: int = 4000) -> str:
        return self.output.read_text(errors="replace")[-num_chars:]

    # -- read ---------------------------------------------------------------------------------

    def get(self, path: str, timeout_s: float = 10.0) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=timeout_s)

    def health(self) -> dict[str, Any]:
        """The router's /health body; {} when it does not answer."""
        try:
            return dict(self.get("/health").json())
        except (httpx.HTTPError, ValueError):
            return {}

    def runtime_pids(self) -> dict[str, int]:
        """Each runtime's process group (its lifeline wrapper's pid), from /health."""
        models = self.health().get("models", {})
        return {r["runtime_id"]: r["pid"] for rs in models.values() for r in rs}

    def wait_serving(self, timeout_s: float) -> list[str]:
        """Wait until every replica is up; the models not serving when `timeout_s` ran out."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.health()
            replicas = [r for rs in health.get("models", {}).values() for r in rs]
            if replicas and all(r["state"] == "up" for r in replicas):
                return []
            if time.monotonic() > deadline:
                return [m for m, s in health.get("model_status", {}).items() if s != "serving"] \
                    or list(self.models)
            time.sleep(2)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 120.0) -> int:
        """Signal the launcher (Ctrl-C by default) and wait for it; SIGKILL to its session if
        it has not exited after `timeout_s`. Its exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL the launcher's whole session (its runtimes die with it: their lifeline)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def sglang_files(self) -> list[str]:
        """The SGLang shm files the fleet's run record names (while the record exists)."""
        record = default_shm_dir() / f"fineslab-{self.fleet_id}.run"
        try:
            runtimes = json.loads(record.read_text())["runtimes"]
        except (OSError, ValueError, KeyError):
            return []
        return [f for r in runtimes.values() for f in r.get("shm_files", [])]

    def leftovers(self, sglang_files: list[str] | None = None, wait_s: float = 0.0) -> Leftovers:
        """What is left of the fleet, after waiting up to `wait_s` for it to go."""
        files = self.sglang_files() if sglang_files is None else sglang_files
        deadline = time.monotonic() + wait_s
        while True:
            left = Leftovers(fleet_processes(self.fleet_id), leftover_files(self.fleet_id, files))
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.5)

    def cleanup(self) -> None:
        """Whatever a failed run leaves: the launcher's session (its zygote too), the fleet's
        processes, and then its arena files and run record (a launcher killed before any
        runtime's lifeline ran leaves nobody else to remove them)."""
        self.kill()
        for pid in fleet_processes(self.fleet_id):
            try:
                stop_group(os.getpgid(pid), grace_s=1.0)
            except ProcessLookupError:
                continue
        remove_dead_fleet_files(self.fleet_id, record_wait_s=0.0)

    def __enter__(self) -> FleetHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The fleet the chaos benchmark abuses: a launcher subprocess and what it leaves behind.

`ChaosFleet.launch(config, folder, name)` writes the config, starts `python -m fineslab.launch`
in a new session and waits for `ready`; the rest reads the router's /health, finds a runtime's
server or scheduler process, checks the slab table, and counts what is left after the launcher
is killed or stopped: processes carrying the fleet's marker (`FINESLAB_FLEET_ID`), SGLang shm
files of its runtimes (from the run record), and its arena files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from fineslab.proctree import FLEET_MARKER, stat_fields, stop_group, tree_pids_of_group
from fineslab.runtime import free_port, lifeline_read_fd
from fineslab.slabs.shm import ArenaPaths, default_shm_dir

READY_TIMEOUT_S = 900.0


def fleet_processes(fleet_id: str) -> list[int]:
    """Live processes whose environment carries `FINESLAB_FLEET_ID=<fleet_id>`."""
    marker = f"{FLEET_MARKER}={fleet_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        if stat_fields(int(entry))[:1] not in ([], ["Z"]):  # gone, or a zombie
            found.append(int(entry))
    return found


def leftover_files(fleet_id: str, sglang_files: list[str]) -> list[str]:
    """The fleet's arena files and the given SGLang shm files that still exist."""
    shm = default_shm_dir()
    arenas = [str(p) for p in shm.glob(f"fineslab-{fleet_id}-*")]
    return arenas + [f for f in sglang_files if Path(f).exists()]


@dataclass
class ChaosFleet:
    proc: subprocess.Popen[bytes]
    base_url: str
    fleet_id: str
    models: list[str]
    output: Path

    @classmethod
    def launch(cls, config: dict[str, Any], folder: Path, name: str) -> ChaosFleet:
        port = free_port()
        config = {**config, "router": {**config.get("router", {}), "port": port}}
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        output = folder / f"{name}.out"
        with open(output, "wb") as out:
            # --stop-with-fd: the fleet stops when this bench dies, even by kill -9.
            proc = subprocess.Popen(
                [sys.executable, "-m", "fineslab.launch", "--config", str(path), "--log-dir",
                 str(folder / f"{name}-logs"), "--stop-with-fd", str(lifeline_read_fd())],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(lifeline_read_fd(),))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while b"\nready\n" not in output.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"fleet {name} did not start:\n"
                                   + output.read_text()[-3000:])
            time.sleep(1)
        return cls(proc, f"http://127.0.0.1:{port}", str(config["fleet_id"]),
                   [m["name"] for m in config["models"]], output)

    def health(self) -> dict[str, Any]:
        try:
            return dict(httpx.get(self.base_url + "/health", timeout=10).json())
        except (httpx.HTTPError, ValueError):
            return {}

    def model_status(self) -> dict[str, str]:
        return dict(self.health().get("model_status", {}))

    def process_of(self, model: str, target: str) -> int | None:
        """The pid of `model`'s SGLang server (`target` "server") or its scheduler."""
        replicas = self.health().get("models", {}).get(model, [])
        if not replicas or replicas[0]["state"] != "up":
            return None
        for pid in tree_pids_of_group(int(replicas[0]["pid"])):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if target == "scheduler" and comm.startswith("sglang::schedul"):
                return pid
            if target == "server" and b"sglang.launch_server" in cmdline \
                    and b"fineslab.lifeline" not in cmdline:  # the wrapper's argv holds it too
                return pid
        return None

    def wait_serving(self, timeout_s: float) -> list[str]:
        """Wait until every replica is up; returns the models that are not serving then."""
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

    def slab_check(self) -> tuple[int, bool]:
        """(slabs held by gone runtimes, check_integrity passed) for every device's table."""
        from fineslab.errors import IntegrityError
        from fineslab.slabs import SlabTable, check_integrity, snapshot

        leaked, ok = 0, True
        for table_path in default_shm_dir().glob(f"fineslab-{self.fleet_id}-*.table"):
            table = SlabTable.open(ArenaPaths(table_path, table_path.with_suffix(".arena")).table,
                                   writable=False)
            try:
                leaked += sum(o.num_slabs for o in snapshot(table).owners if not o.alive)
                check_integrity(table)
            except IntegrityError:
                ok = False
            finally:
                table.close()
        return leaked, ok

    def _sglang_files(self) -> list[str]:
        record = default_shm_dir() / f"fineslab-{self.fleet_id}.run"
        try:
            runtimes = json.loads(record.read_text())["runtimes"]
        except (OSError, ValueError, KeyError):
            return []
        return [f for r in runtimes.values() for f in r.get("shm_files", [])]

    def _count_left(self, sglang_files: list[str], wait_s: float) -> dict[str, int]:
        deadline = time.monotonic() + wait_s
        while (fleet_processes(self.fleet_id) or leftover_files(self.fleet_id, sglang_files)) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        return {"orphans": len(fleet_processes(self.fleet_id)),
                "shm_files_left": len(leftover_files(self.fleet_id, sglang_files))}

    def kill_launcher_and_count(self) -> dict[str, int]:
        """SIGKILL the launcher alone; what of the fleet is left 60 s later."""
        files = self._sglang_files()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        return self._count_left(files, 60.0)

    def interrupt(self) -> dict[str, float]:
        """Ctrl-C; the stop's seconds and what is left (the run record must be gone too)."""
        files = [*self._sglang_files(), str(default_shm_dir() / f"fineslab-{self.fleet_id}.run")]
        start_s = time.monotonic()
        os.kill(self.proc.pid, signal.SIGINT)
        self.proc.wait(120)
        stop_s = time.monotonic() - start_s
        return {**self._count_left(files, 10.0), "stop_s": round(stop_s, 2)}

    def cleanup(self) -> None:
        """Whatever the benchmark leaves on failure: the launcher and the fleet's processes."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in fleet_processes(self.fleet_id):
            try:
                stop_group(os.getpgid(pid), grace_s=1.0)
            except ProcessLookupError:
                continue

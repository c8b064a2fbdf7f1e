"""The fleet the chaos benchmark abuses: a `FleetHandle` (fineslab.fleet) plus what chaos
needs of it: a runtime's server or scheduler process, the slab table's check, and what is left
after the launcher is killed or interrupted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from fineslab.fleet import FleetHandle, Leftovers
from fineslab.fleet.handle import fleet_processes, leftover_files
from fineslab.proctree import tree_pids_of_group
from fineslab.slabs.shm import ArenaPaths, default_shm_dir

__all__ = ["ChaosFleet", "fleet_processes", "leftover_files"]


class ChaosFleet(FleetHandle):
    def model_status(self) -> dict[str, str]:
        return dict(self.health().get("model_status", {}))

    def held_slots(self, model: str) -> int:
        """Router slots the model's requests hold: queued, and in flight on its runtimes."""
        health = httpx.get(self.base_url + "/health", timeout=30).json()
        inflight = sum(int(r.get("inflight", 0)) for r in health["models"].get(model, []))
        queued = 0
        for line in httpx.get(self.base_url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(f'fineslab_queue_length{{model="{model}"}}'):
                queued = int(float(line.split()[-1]))
        return inflight + queued

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

    def kill_launcher_and_count(self) -> dict[str, int]:
        """SIGKILL the launcher alone; what of the fleet is left 60 s later."""
        files = self.sglang_files()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        return _counts(self.leftovers(files, wait_s=60.0))

    def interrupt(self) -> dict[str, float]:
        """Ctrl-C; the stop's seconds and what is left (the run record must be gone too)."""
        files = [*self.sglang_files(), str(default_shm_dir() / f"fineslab-{self.fleet_id}.run")]
        start_s = time.monotonic()
        os.kill(self.proc.pid, signal.SIGINT)
        self.proc.wait(120)
        stop_s = time.monotonic() - start_s
        return {**_counts(self.leftovers(files, wait_s=10.0)), "stop_s": round(stop_s, 2)}


def _counts(left: Leftovers) -> dict[str, int]:
    return {"orphans": len(left.processes), "shm_files_left": len(left.files)}

"""What the cluster tests look for among this machine's processes."""

from __future__ import annotations

import os
from pathlib import Path


def fleet_pids(fleet_id: str) -> list[int]:
    """Live processes whose command line or environment names this fleet: its node fleets
    (their work folder is named by the fleet id; they fork away from their agent, so they are
    no test process's children) and their runtimes (FINESLAB_FLEET)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            blob = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if fleet_id.encode() in blob:
            pids.append(int(entry.name))
    return pids

"""`python -m fineslab.slabs`: print the slab table of a live arena (read-only, lock-free).

    python -m fineslab.slabs --fleet FLEET --device cpu0 [--shm-dir DIR] [--check] [--json]
    python -m fineslab.slabs --table /dev/shm/fineslab-FLEET-cpu0.table

Shows slabs per key (block stride) and state, bytes used per owner (with liveness, so a runtime
that died shows up before its slabs are reclaimed), and the free bytes. `--check` also runs
check_integrity (exact only while the runtimes are idle) and exits 1 on a violation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from fineslab.errors import IntegrityError
from fineslab.slabs.integrity import TableSnapshot, check_integrity, snapshot
from fineslab.slabs.shm import ArenaPaths
from fineslab.slabs.table import SlabTable
from fineslab.tables import format_table


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def render(path: Path, snap: TableSnapshot) -> str:
    """The human report of one table snapshot."""
    arena_bytes = snap.num_slabs * snap.slab_bytes
    lines = [f"slab table {path}",
             f"arena {human_bytes(arena_bytes)} = {snap.num_slabs} slabs x "
             f"{human_bytes(snap.slab_bytes)}; free {human_bytes(snap.free_bytes)} "
             f"({snap.free_slabs} slabs)", ""]
    rows = [[key, state, count, human_bytes(count * snap.slab_bytes)]
            for (key, state), count in sorted(snap.slabs_by_key_state.items())]
    lines += [format_table(["key (block B)", "state", "slabs", "bytes"], rows), ""]
    owner_rows = [[o.runtime_id, o.pid, "yes" if o.alive else "DEAD", o.key,
                   "key pool" if o.pooled else "own", o.num_slabs, o.used_blocks,
                   o.free_blocks, human_bytes(o.used_bytes),
                   "-" if o.kv_limit_bytes is None else human_bytes(o.kv_limit_bytes)]
                  for o in snap.owners]
    lines.append(format_table(["runtime", "pid", "alive", "block B", "slabs of", "slabs",
                               "used blocks", "free blocks", "used", "KV limit"], owner_rows)
                 if owner_rows else "no runtimes attached")
    return "\n".join(lines)


def as_dict(snap: TableSnapshot) -> dict[str, object]:
    return {
        "slab_bytes": snap.slab_bytes, "num_slabs": snap.num_slabs,
        "free_bytes": snap.free_bytes,
        "slabs_by_key_state": [{"key": k, "state": s, "slabs": c}
                               for (k, s), c in sorted(snap.slabs_by_key_state.items())],
        "owners": [{"runtime_id": o.runtime_id, "pid": o.pid, "alive": o.alive, "key": o.key,
                    "pooled": o.pooled, "slabs": o.num_slabs, "used_blocks": o.used_blocks,
                    "free_blocks": o.free_blocks, "used_bytes": o.used_bytes,
                    "kv_limit_bytes": o.kv_limit_bytes}
                   for o in snap.owners],
    }


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="python -m fineslab.slabs", description=__doc__)
    parser.add_argument("--fleet", help="fleet id the launcher used")
    parser.add_argument("--device", default="cpu0", help="device of the arena (cpu0, cuda:0)")
    parser.add_argument("--shm-dir", type=Path, help="folder of the shm files (/dev/shm)")
    parser.add_argument("--table", type=Path, help="the table file, instead of fleet/device")
    parser.add_argument("--check", action="store_true", help="also run check_integrity")
    parser.add_argument("--json", action="store_true", help="one JSON object instead")
    args = parser.parse_args(argv)
    if args.table is None and args.fleet is None:
        parser.error("give --fleet (and --device) or --table")
    path = args.table or ArenaPaths.of(args.fleet, args.device, args.shm_dir).table
    table = SlabTable.open(path, writable=False)
    try:
        snap = snapshot(table)
        out.write((json.dumps(as_dict(snap)) if args.json else render(path, snap)) + "\n")
        if args.check:
            try:
                check_integrity(table)
            except IntegrityError as err:
                out.write(f"INTEGRITY VIOLATION: {err}\n")
                return 1
            out.write("integrity: ok\n")
    finally:
        table.close()
    return 0

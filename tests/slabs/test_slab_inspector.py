"""`python -m fineslab.slabs`: the report of a live table, its JSON, and --check."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from slab_constants import FMT_A, FMT_B, NUM_SLABS, SLAB_BYTES

from fineslab.slabs.arena import SlabArena
from fineslab.slabs.inspector import human_bytes, main
from fineslab.slabs.pooled import PooledSlabs


def test_json_report_counts_slabs_and_owners(arena: SlabArena, tmp_path: Path) -> None:
    arena.client("llama", FMT_A).alloc(11)
    arena.client("qwen", FMT_B).alloc(2)
    out = io.StringIO()
    assert main(["--table", str(arena.paths.table), "--json"], out) == 0
    report = json.loads(out.getvalue())
    assert report["free_bytes"] == (NUM_SLABS - 3) * SLAB_BYTES
    owners = {o["runtime_id"]: o for o in report["owners"]}
    assert owners["llama"]["used_bytes"] == 11 * 512 and owners["llama"]["slabs"] == 2
    assert owners["qwen"]["used_blocks"] == 2 and owners["qwen"]["alive"] is True
    states = {(s["key"], s["state"]): s["slabs"] for s in report["slabs_by_key_state"]}
    assert states == {(0, "FREE"): 3, (512, "FULL"): 1, (512, "PARTIAL"): 1,
                      (1024, "PARTIAL"): 1}


def test_report_shows_key_pool_members_and_the_pools_free_blocks(arena: SlabArena) -> None:
    # without block caches, so the pool's free blocks are exactly the slab's rest
    PooledSlabs(arena.table, "r0", FMT_A, cache_blocks=0).alloc(3)
    PooledSlabs(arena.table, "r1", FMT_A, cache_blocks=0).alloc(2)
    out = io.StringIO()
    assert main(["--table", str(arena.paths.table), "--json"], out) == 0
    owners = {o["runtime_id"]: o for o in json.loads(out.getvalue())["owners"]}
    assert owners["r0"]["pooled"] and owners["r1"]["pooled"]
    assert owners["r0"]["slabs"] == owners["r1"]["slabs"] == 1, "both in the one pool slab"
    assert owners["r0"]["free_blocks"] == owners["r1"]["free_blocks"] == 3
    human = io.StringIO()
    assert main(["--table", str(arena.paths.table)], human) == 0
    assert "key pool" in human.getvalue()


def test_check_flags_a_broken_table(arena: SlabArena) -> None:
    arena.client("llama", FMT_A).alloc(3)
    arena.table.used[0] = 5  # counts no longer match the free map
    out = io.StringIO()
    assert main(["--table", str(arena.paths.table), "--check"], out) == 1
    assert "INTEGRITY VIOLATION" in out.getvalue() and "T3" in out.getvalue()


def test_module_runs_by_fleet_and_device(arena: SlabArena) -> None:
    arena.client("llama", FMT_A).alloc(1)
    shm_dir = arena.paths.table.parent
    done = subprocess.run([sys.executable, "-m", "fineslab.slabs", "--fleet", "test",
                           "--device", "cpu0", "--shm-dir", str(shm_dir), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "llama" in done.stdout and "integrity: ok" in done.stdout


def test_human_bytes_picks_the_unit() -> None:
    assert human_bytes(512) == "512 B" and human_bytes(3 << 20) == "3.00 MiB"
    assert human_bytes(5 << 40) == "5120.00 GiB"

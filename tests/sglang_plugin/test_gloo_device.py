"""Single-rank gloo groups share one device (fineslab/sglang_plugin/gloo_device.py): one loop
thread where torch made one per group, collectives as before, groups of several ranks as torch
builds them, and a real runtime's scheduler with one gloo loop where it had nine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fineslab.proctree import descendant_pids
from fineslab.runtime import ServerProcess, ServerSpec, free_port

GROUPS = """
import os, sys, torch, torch.distributed as dist
from fineslab.sglang_plugin.gloo_device import share_single_rank_devices
if sys.argv[1] == "shared":
    assert share_single_rank_devices() and share_single_rank_devices()
rank, size, port = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=size)
groups = [dist.new_group(list(range(size)), backend="gloo") for _ in range(8)]
t = torch.full((3,), float(rank + 1))
for g in [None, *groups]:
    x = t.clone()
    dist.all_reduce(x, group=g)
    dist.barrier(group=g)
    got = [None] * size
    dist.all_gather_object(got, rank, group=g)
    assert got == list(range(size)), got
loops = sum(1 for t in os.listdir("/proc/self/task")
            if open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop")
print(loops, x.tolist(), flush=True)
dist.destroy_process_group()
"""


def _run(mode: str, size: int) -> list[str]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", GROUPS, mode, str(rank), str(size), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(size)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        outs.append(out.strip())
    return outs


def test_single_rank_groups_share_one_loop_thread_and_compute_as_before() -> None:
    assert _run("torch", 1) == ["9 [1.0, 1.0, 1.0]"], "torch alone: a device per group"
    assert _run("shared", 1) == ["1 [1.0, 1.0, 1.0]"]


def test_groups_of_two_ranks_are_built_as_torch_builds_them() -> None:
    """A device per group, as torch alone makes them (above), and the ranks' sum."""
    assert _run("shared", 2) == ["9 [3.0, 3.0, 3.0]"] * 2


@pytest.mark.slow
def test_a_runtimes_scheduler_runs_one_gloo_loop(model_cache: Path, tmp_path: Path) -> None:
    """Through the plugin's entry point, in a real SGLang runtime (tp=1: nine groups)."""
    spec = ServerSpec(str(model_cache / "llama-tiny"), free_port(),
                      extra_args=("--max-total-tokens", "1024"))
    with ServerProcess(spec, tmp_path / "server.log") as server:
        server.wait_healthy(300)
        time.sleep(1)
        loops = {pid: sum(1 for t in os.listdir(f"/proc/{pid}/task")
                          if Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
                          == "gloo_tcp_loop")
                 for pid in descendant_pids(server.proc.pid)}
        assert max(loops.values()) == 1, loops

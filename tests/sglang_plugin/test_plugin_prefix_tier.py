"""The lent tier (SwiftCache, issue #20) on a real CPU SGLang server in an arena.

Runtime "m": llama-tiny, BF16 KV (2 KiB a token), page 16, `--max-total-tokens 640` (its own KV
capped small, so its radix cache evicts), `FINESLAB_PREFIX_LENDING=20` and
`--radix-cache-backend fineslab_lent`; runtime "n", its neighbour (a lender): llama-tiny, radix
cache off. The arena: 24 slabs of 256 KiB (128 tokens each).

Each scenario: a first turn leaves its history in m's radix cache; fillers evict it (their
prompts need the room), so the history's pages go to lent slabs; the second turn (history +
answer + new input) then finds them. The reference of a second turn is the same server's output
with the prefix recomputed: its radix cache flushed and its lent pages dropped first. (A stock
in-process engine cannot be the reference here: its shutdown kills every child process of the
test, this server included.) The tests run in file order on one server; the last one kills it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from plugin_test_support import (
    ScratchArena,
    arena_for,
    generate_concurrently,
    kv_shape,
    prompts,
    tie_problem,
)

from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.slabs import check_integrity
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.lent import lent_slabs
from fineslab.slabs.table import SlabState

pytestmark = pytest.mark.slow

PAGE = 16
SLAB = 256 << 10
NUM_SLABS = 24
LEND_CAP = 20
NEW = 8
FMT = BlockFormat.unpadded(kv_shape("llama-tiny", "bfloat16", "m"), PAGE)


@dataclasses.dataclass
class Borrower:
    server: ServerProcess
    arena: ScratchArena
    neighbour: ServerProcess  # "n": llama-tiny in the same arena, no lent tier (a lender)

    def generate(self, input_ids: list[int]) -> tuple[list[int], int]:
        """Greedy output ids and the cached (not prefilled) prompt tokens."""
        reply = httpx.post(self.server.spec.base_url + "/generate", timeout=300, json={
            "input_ids": input_ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})
        reply.raise_for_status()
        body = reply.json()
        return list(body["output_ids"]), int(body["meta_info"]["cached_tokens"])

    def recomputed(self, input_ids: list[int]) -> list[int]:
        """The output with nothing cached: radix cache flushed, lent pages dropped."""
        httpx.post(self.server.spec.base_url + "/flush_cache", timeout=60).raise_for_status()
        table = self.arena.arena.table
        with table.lock():
            table.drop_lent_locked(np.flatnonzero(table.lent_to != 0))
        out, cached = self.generate(input_ids)
        assert cached == 0
        return out

    def lent(self) -> int:
        return lent_slabs(self.arena.arena.table).get("m", 0)

    def first_turn_then_evict(self, seed: int) -> tuple[list[int], list[int]]:
        """Turn 1 of a 320-token history; fillers evict it from the radix cache. Returns the
        second turn's prompt and the history length whose pages should be lent."""
        history = prompts(1, 320, seed=seed)[0]
        answer, _ = self.generate(history)
        for filler in prompts(4, 300, seed=seed + 1):
            self.generate(filler)
        return history + answer + prompts(1, 40, seed=seed + 2)[0], history


@pytest.fixture(scope="module")
def borrower(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Borrower]:
    arena = arena_for([FMT.shape], PAGE, SLAB, NUM_SLABS)
    join = dataclasses.replace(arena.join("m"), prefix_lending=LEND_CAP)
    spec = ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--dtype", "bfloat16", "--page-size", str(PAGE), "--max-total-tokens", "640",
        "--radix-cache-backend", "fineslab_lent", "--log-level", "warning"), env=join.environ())
    logs = tmp_path_factory.mktemp("prefix")
    server = ServerProcess(spec, logs / "m.log")
    neighbour = ServerProcess(ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--dtype", "bfloat16", "--page-size", str(PAGE), "--disable-radix-cache",
        "--log-level", "warning"), env=arena.join("n").environ()), logs / "n.log")
    try:
        server.wait_healthy(300)
        neighbour.wait_healthy(300)
        yield Borrower(server, arena, neighbour)
    finally:
        server.stop()
        neighbour.stop()
        arena.close()


def test_a_second_turn_loads_its_evicted_history_from_lent_slabs_and_matches_a_recompute(
        borrower: Borrower) -> None:
    turn2, history = borrower.first_turn_then_evict(seed=31)
    assert borrower.lent() > 0, "the evicted history went to lent slabs"
    out, cached = borrower.generate(turn2)
    assert cached >= len(history) // PAGE * PAGE, \
        f"{cached} cached tokens: the history came back from the lent tier, not recomputed"
    problem = tie_problem(borrower.server.spec.base_url, turn2, borrower.recomputed(turn2),
                          out)
    assert problem is None, problem
    check_integrity(borrower.arena.arena.table, exact_owners=[])


def test_corrupted_lent_pages_change_the_output_so_the_loaded_kv_is_what_is_used(
        borrower: Borrower) -> None:
    """The negative control of the test above: the same path with the lent bytes scrambled."""
    turn2, history = borrower.first_turn_then_evict(seed=41)
    table = borrower.arena.arena.table
    lent = [int(s) for s in range(NUM_SLABS)
            if table.lent_to[s] != 0 and table.state[s] == SlabState.FREE]
    assert lent
    arena = borrower.arena.arena.tensor()
    assert isinstance(arena, torch.Tensor)
    noise = torch.Generator().manual_seed(0)
    for slab in lent:
        values = torch.randn(SLAB // 2, generator=noise).to(torch.bfloat16) * 4
        arena[slab * SLAB: (slab + 1) * SLAB] = values.view(torch.uint8)
    out, cached = borrower.generate(turn2)
    assert cached >= len(history) // PAGE * PAGE
    assert out != borrower.recomputed(turn2), "scrambled KV must show in the output"


def test_a_lenders_burst_takes_lent_slabs_at_once_and_the_borrower_recomputes(
        borrower: Borrower) -> None:
    turn2, history = borrower.first_turn_then_evict(seed=51)
    assert borrower.lent() > 0
    lender = borrower.arena.arena.client("lender", FMT)
    started = time.perf_counter()
    taken = lender.alloc(lender.available_blocks())  # every free slab, the lent ones too
    took_s = time.perf_counter() - started
    assert taken and borrower.lent() == 0, "the burst took every lent slab back"
    assert took_s < 1.0, f"the lender waited {took_s:.3f} s"
    lender.free(taken)
    lender.close()
    out, cached = borrower.generate(turn2)
    assert cached < len(history) // PAGE * PAGE, "the dropped pages were recomputed"
    problem = tie_problem(borrower.server.spec.base_url, turn2, borrower.recomputed(turn2),
                          out)
    assert problem is None, problem
    check_integrity(borrower.arena.arena.table, exact_owners=[])


def test_a_real_neighbours_burst_takes_lent_slabs_and_both_models_serve_without_error(
        borrower: Borrower) -> None:
    turn2, _ = borrower.first_turn_then_evict(seed=55)
    lent_before = borrower.lent()
    assert lent_before > 0
    # Four 600-token prompts at once: about 2,400 tokens of KV, 19 of the arena's 128-token
    # slabs, more than its unlent free slabs, so the burst must take lent ones.
    burst = prompts(4, 600, seed=56)
    outputs = generate_concurrently(borrower.neighbour.spec.base_url, burst, NEW)
    assert all(isinstance(o, list) and len(o) == NEW for o in outputs), outputs
    assert borrower.lent() < lent_before, "the neighbour's burst took lent slabs back"
    out, _ = borrower.generate(turn2)
    problem = tie_problem(borrower.server.spec.base_url, turn2, borrower.recomputed(turn2), out)
    assert problem is None, problem
    check_integrity(borrower.arena.arena.table, exact_owners=[])


def test_sigkill_of_a_lender_holding_taken_lent_slabs_leaks_no_slab(borrower: Borrower) -> None:
    borrower.first_turn_then_evict(seed=61)
    assert borrower.lent() > 0
    table = borrower.arena.arena.table
    script = (
        "import sys, time\n"
        "from fineslab.slabs.arena import SlabArena\n"
        "from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape\n"
        f"arena = SlabArena.attach({borrower.arena.fleet_id!r}, 'cpu:0')\n"
        "fmt = BlockFormat.unpadded(KVShape('x', 4, 2, 64, KVDtype.BF16), 16)\n"
        "rt = arena.client('lender', fmt)\n"
        "rt.alloc(rt.available_blocks())\n"
        "print('taken', flush=True)\n"
        "time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "taken"
        assert borrower.lent() == 0
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert table.reclaim_dead_owners() == ["lender"]
    check_integrity(table, exact_owners=[])
    out, _ = borrower.generate(prompts(1, 64, seed=62)[0])
    assert len(out) == NEW, "the borrower serves on"


def test_sigkill_of_the_borrower_leaks_no_lent_slab(borrower: Borrower) -> None:
    borrower.first_turn_then_evict(seed=71)
    table = borrower.arena.arena.table
    assert borrower.lent() > 0
    os.killpg(borrower.server.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "m" not in table.reclaim_dead_owners():
        time.sleep(0.2)
    assert not table.lent_to.any(), "the dead borrower's lent marks went with its slot"
    assert "m" not in table.active_runtimes().values()
    check_integrity(table, exact_owners=[])
    assert len(generate_concurrently(borrower.neighbour.spec.base_url,
                                     prompts(1, 32, seed=72), NEW)[0]) == NEW, \
        "the neighbour serves on"

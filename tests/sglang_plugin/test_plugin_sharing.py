"""Two SGLang servers of different KV precision share one arena (real processes, CPU).

Runtime "a": llama-tiny, BF16 KV (2,048 B a token); runtime "b": qwen2-tiny, FP16 KV (1,536 B a
token); page size 16; slabs of 96 KiB hold 3 blocks of "a" or 4 of "b"; the arena has 24
slabs (2.25 MiB: 1,152 tokens of "a" or 1,536 of "b"), of which slab 0, the padding slab, holds
no KV (SGLang's padded writes land there; whichever runtime draws it first keeps it parked), so
each runtime can get 23 slabs: 1,104 tokens of "a", 1,472 of "b". Radix caching is off, so a
finished request's KV goes back at once (an idle runtime's cached prefixes are not given back to its
neighbours by this plugin: that needs a policy asking the runtime to /flush_cache).

The tests run in file order on one pair of servers: co-location, dynamic sharing (paper Fig. 4,
with a static-partition pair for comparison), then the fault test, which kills "b".
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from plugin_test_support import (
    Reference,
    ScratchArena,
    UsageSampler,
    arena_for,
    generate_batch,
    generate_concurrently,
    generate_http,
    kv_shape,
    prompts,
    settled_integrity,
    tie_problem,
)

from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin.accounting import read_memory

pytestmark = pytest.mark.slow

PAGE = 16
SLAB_BYTES = 96 << 10
NUM_SLABS = 24
MODELS = {"a": ("llama-tiny", "bfloat16"), "b": ("qwen2-tiny", "float16")}
# Phase loads. SGLang admits a request only when its prompt, all of its max_new_tokens
# (ignore_eos: no early-stop discount) and a page of headroom fit next to what the running
# requests have reserved, so how full the pool gets is set by which requests SGLang admits
# together. B's load is therefore two requests that are always admitted together, sent as one
# batch (one message to SGLang's scheduler; as two HTTP requests they reached it 32 tokens apart
# on a machine at load 7, and B peaked at 86 pages, under 90%): 2 x (prompt + 680 + 16) = 1,436
# tokens <= 1,472, B's capacity (23 slabs: slab 0 is the padding slab); at their last step they
# hold 44 + 44 = 88 of the arena's 96 pages of B
# (92%, 22 slabs), more than the 86.4 pages that 90% needs. Exactly 22 slabs, so that B never
# needs the one slab left free: a waiting runtime's failed admission pass keeps the pages it
# reserved for its first request (SlabPrefillBudget draws before SGLang's ignore_eos check
# refuses), and A, waiting from the moment B reaches 90%, holds that slab. With prompts of 24 and
# 27 tokens B needed a 23rd slab for its 89th page two steps before its end: when A's burst came
# in before that page, B found the arena short, SGLang retracted one of B's requests, and its
# re-prefill took the memory A's waiting requests were to get (a rehearsal: A peaked at 49%).
# A's burst is eight requests that want more than A's 72 pages. Prompt lengths are staggered so
# requests open new pages on different steps.
LOADS = {"a": [p[: 24 + 3 * i] for i, p in enumerate(prompts(8, 48, seed=11))],
         "b": [p[: 24 - 4 * i] for i, p in enumerate(prompts(2, 60, seed=12))]}
NEW_TOKENS = {"a": 96, "b": 680}
SMALL = {"a": prompts(4, 32, seed=21), "b": prompts(4, 32, seed=22)}


@dataclass
class Pair:
    """Runtimes "a" and "b"; `arenas[rid]` is the arena each one joined."""

    servers: dict[str, ServerProcess]
    arenas: dict[str, ScratchArena]

    def url(self, rid: str) -> str:
        return self.servers[rid].spec.base_url


def start_pair(model_cache: Path, logs: Path, arenas: dict[str, ScratchArena],
               only: tuple[str, ...] = tuple(MODELS)) -> Pair:
    """Start the servers at once (each joins `arenas[rid]`) and wait until all are healthy."""
    servers: dict[str, ServerProcess] = {}
    try:
        for rid in only:
            model, dtype = MODELS[rid]
            spec = ServerSpec(str(model_cache / model), free_port(), extra_args=(
                "--dtype", dtype, "--page-size", str(PAGE), "--disable-radix-cache",
                "--log-level", "warning"), env=arenas[rid].join(rid).environ())
            servers[rid] = ServerProcess(spec, logs / f"{rid}-{arenas[rid].fleet_id}.log")
        for server in servers.values():
            server.wait_healthy(300)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return Pair(servers, arenas)


@pytest.fixture(scope="module")
def references(stock_outputs: Reference) -> Reference:
    """Every stand-alone output these tests compare with, computed before any server starts:
    an in-process Engine's shutdown kills every child process of the test process, servers
    included."""
    for rid, (model, dtype) in MODELS.items():  # one engine per model
        stock_outputs.prefetch(model, PAGE, dtype, [  # type: ignore[attr-defined]
            (tuple(tuple(p) for p in SMALL[rid]), 24),
            (tuple(tuple(p) for p in LOADS[rid]), NEW_TOKENS[rid])])
    return stock_outputs


@pytest.fixture(scope="module")
def shared(model_cache: Path, tmp_path_factory: pytest.TempPathFactory,
           references: Reference) -> Iterator[Pair]:
    shapes = [kv_shape(model, dtype, rid) for rid, (model, dtype) in MODELS.items()]
    arena = arena_for(shapes, PAGE, SLAB_BYTES, NUM_SLABS)
    pair = start_pair(model_cache, tmp_path_factory.mktemp("logs"), {"a": arena, "b": arena})
    yield pair
    for server in pair.servers.values():
        server.stop()
    arena.close()


def reference(stock_outputs: Reference, rid: str, input_ids: list[list[int]],
              new_tokens: int) -> list[list[int]]:
    model, dtype = MODELS[rid]
    return stock_outputs(model, PAGE, dtype, tuple(tuple(p) for p in input_ids), new_tokens)


def test_two_precisions_serve_concurrently_with_correct_output(
        shared: Pair, stock_outputs: Reference) -> None:
    results: dict[str, list[list[int] | BaseException]] = {}

    def run(rid: str) -> None:
        results[rid] = generate_concurrently(shared.url(rid), SMALL[rid], 24)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in MODELS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid in MODELS:
        want = reference(stock_outputs, rid, SMALL[rid], 24)
        problems = [p for prompt, w, h in zip(SMALL[rid], want, results[rid], strict=True)
                    if (p := tie_problem(shared.url(rid), prompt, w, h)) is not None]
        assert not problems, (
            f"runtime {rid}: co-located output must equal its stand-alone output up to ties: "
            f"{problems}")
    arena = shared.arenas["a"]
    wait_idle(arena)
    memory = read_memory(arena.fleet_id, "cpu0", tokens_per_block={"a": PAGE, "b": PAGE})
    for rid in MODELS:
        model = memory.of(rid)
        assert model is not None and model.alive, f"the table must list live runtime {rid}"
    assert sum(m.used_bytes for m in memory.models) <= SLAB_BYTES, (
        f"between requests the runtimes hold at most the parked padding slab: {memory.models}")
    held = sum(m.held_bytes for m in memory.models)
    assert memory.free_bytes + held == memory.arena_bytes == arena.arena_bytes, (
        "free space plus every runtime's slabs must be the whole arena")
    settled_integrity(arena.arena.table)


def wait_idle(arena: ScratchArena, timeout_s: float = 30.0) -> dict[str, int]:
    """Each runtime's used bytes once they add up to at most the padding slab, or after
    `timeout_s` (a runtime frees a request's KV just after answering it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum(arena.used_bytes().values()) > SLAB_BYTES:
        time.sleep(0.1)
    return arena.used_bytes()


def run_phases(pair: Pair, sampler: UsageSampler, with_a: bool = True
               ) -> tuple[dict[str, list], float]:
    """B's load alone; once B holds >= 90% of its arena (or its load ends), A's burst.

    Returns each runtime's outputs and B's peak fraction before A's burst arrived.
    """
    results: dict[str, list] = {}
    b_thread = threading.Thread(target=lambda: results.__setitem__(
        "b", generate_batch(pair.url("b"), LOADS["b"], NEW_TOKENS["b"])))
    b_thread.start()
    arena_b = pair.arenas["b"].arena_bytes
    while b_thread.is_alive() and sampler.peak_fraction("b", arena_b) < 0.9:
        time.sleep(0.02)
    b_peak_alone = sampler.peak_fraction("b", arena_b)
    if with_a:
        results["a"] = generate_concurrently(pair.url("a"), LOADS["a"], NEW_TOKENS["a"])
    b_thread.join()
    return results, b_peak_alone


def check_outputs(pair: Pair, stock_outputs: Reference, results: dict[str, list],
                  what: str) -> None:
    """Each output equals its stand-alone output, or parts from it only at a tie."""
    for rid, outputs in results.items():
        want = reference(stock_outputs, rid, LOADS[rid], NEW_TOKENS[rid])
        problems = [f"request {i}: {problem}" for i, (prompt, w, h)
                    in enumerate(zip(LOADS[rid], want, outputs, strict=True))
                    if (problem := tie_problem(pair.url(rid), prompt, w, h)) is not None]
        assert not problems, (
            f"runtime {rid}: output {what} must equal its stand-alone output up to ties:\n"
            + "\n".join(problems) + "\nserver log:\n" + pair.servers[rid].log_tail(40))


def test_dynamic_sharing_beats_static_partitions(
        shared: Pair, model_cache: Path, tmp_path_factory: pytest.TempPathFactory,
        stock_outputs: Reference) -> None:
    arena = shared.arenas["a"]
    with UsageSampler(arena) as sampler:
        results, b_alone = run_phases(shared, sampler)
    check_outputs(shared, stock_outputs, results, "under memory pressure")
    assert b_alone >= 0.9, (f"with A idle, B must hold >= 90% of the arena (held {b_alone:.0%}); "
                            f"usage over time:\n{sampler.describe()}")
    # A's burst wants more than A's 72 pages; once B's requests are done A must get the memory.
    # Before admission_reopens, A admitted what fitted while B still ran and then waited for its
    # own requests to end (SGLang's batch_is_full), peaking at 51% in one of three runs.
    a_peak = sampler.peak_fraction("a")
    assert a_peak >= 0.7, (
        f"after B's requests finish, A must get at least 70% of the arena ({a_peak:.0%}); "
        f"usage over time:\n{sampler.describe()}")
    idle = wait_idle(arena)
    assert sum(idle.values()) <= SLAB_BYTES, (
        f"once every request is answered the runtimes hold at most the parked padding slab; "
        f"held {idle}")

    # The same load on B with static partitions: B alone in its half of the KV memory (A's half
    # would sit idle, so A is not started). Each partition has its own padding slab, as each
    # stock SGLang pool has its own padding page: 12 KV slabs + 1.
    half = ScratchArena.create(SLAB_BYTES, NUM_SLABS // 2 + 1, 4)
    static = start_pair(model_cache, tmp_path_factory.mktemp("static"), {"b": half},
                        only=("b",))
    try:
        with UsageSampler(half) as b_sampler:
            static_results, _ = run_phases(static, b_sampler, with_a=False)
        check_outputs(static, stock_outputs, static_results, "in a static partition")
    finally:
        static.servers["b"].stop()
        half.close()
    b_static = b_sampler.peaks.get("b", 0) / arena.arena_bytes
    cap = half.arena_bytes / arena.arena_bytes  # 13 / 24: half the KV slabs, plus padding
    assert b_static <= cap, (f"a static partition caps B at half the KV memory plus its padding "
                             f"slab ({cap:.0%}; held {b_static:.0%})")
    print(f"\nB alone: shared {b_alone:.0%} vs static {b_static:.0%} of the memory; "
          f"A's peak when shared: {a_peak:.0%}")


def test_sigkill_returns_slabs_and_neighbour_keeps_serving(
        shared: Pair, stock_outputs: Reference) -> None:
    arena = shared.arenas["a"]
    for rid in MODELS:  # what the earlier tests left: both runtimes whole and healthy
        assert shared.servers[rid].tree_intact(), (
            f"runtime {rid} lost a process before the fault test:\n"
            + shared.servers[rid].log_tail(40))
        shared.servers[rid].wait_healthy(60)
    b_results: dict[str, list] = {}
    b_thread = threading.Thread(target=lambda: b_results.__setitem__(
        "b", generate_concurrently(shared.url("b"), LOADS["b"], NEW_TOKENS["b"])))
    b_thread.start()
    # A quarter of the arena: one of B's requests reaches it alone (44 pages at its end), so
    # the kill lands mid-flight even when B admits its two requests one after the other.
    while b_thread.is_alive() and arena.used_bytes().get("b", 0) < arena.arena_bytes // 4:
        time.sleep(0.02)
    used = arena.used_bytes()
    assert used.get("b", 0) > 0 and b_thread.is_alive(), (
        f"B must hold arena memory, its requests in flight, when it is killed; held {used}, "
        f"B's requests gave {b_results.get('b')!r}\nB's log:\n"
        + shared.servers["b"].log_tail(60))
    for pid in shared.servers["b"].tree_pids():  # server, scheduler and detokenizer
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    b_thread.join()
    assert any(isinstance(r, BaseException) for r in b_results["b"]), (
        "B must have been killed with requests in flight")
    # SIGKILL is delivered asynchronously: a process with a large mapping can take a moment to
    # tear down on a loaded machine, and until then /proc shows it alive (CI saw this once).
    deadline = time.monotonic() + 30
    while shared.servers["b"].tree_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shared.servers["b"].tree_pids(), "B's processes must be gone after SIGKILL"
    reclaimed = arena.arena.table.reclaim_dead_owners()
    assert "b" in reclaimed or "b" not in arena.used_bytes(), "B's slabs must be reclaimed"
    assert "b" not in arena.used_bytes(), "a dead runtime must hold no slabs"
    settled_integrity(arena.arena.table)
    out = generate_concurrently(shared.url("a"), LOADS["a"], NEW_TOKENS["a"])
    check_outputs(shared, stock_outputs, {"a": out}, "after its neighbour died")
    alone = generate_http(shared.url("a"), SMALL["a"][0], 24)
    problem = tie_problem(shared.url("a"), SMALL["a"][0],
                          reference(stock_outputs, "a", SMALL["a"], 24)[0], alone)
    assert problem is None, f"A must keep serving after its neighbour died: {problem}"
    settled_integrity(arena.arena.table)

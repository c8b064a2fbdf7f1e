"""Sleep and wake through SGLang's own API (issue #16), on a real CPU server in an arena.

`/pause_generation {"mode":"retract"}`, `/release_memory_occupation {"tags":["weights",
"kv_cache"]}` puts the runtime to sleep: its weight slabs and KV pages go back to the arena
(the slab table shows 0 for both) and a neighbour can take them. `/resume_memory_occupation`
and `/continue_generation` wake it onto other slabs, and greedy output equals what it gave
before the sleep.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from plugin_test_support import (
    ScratchArena,
    arena_for,
    generate_http,
    kv_shape,
    prompts,
    settled_integrity,
)

from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.slabs import snapshot
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.streamctl import host_copy_path

pytestmark = pytest.mark.slow

PROMPTS = prompts(2, 20, seed=5)
NEW_TOKENS = 10
SLAB = 1 << 20
TAGS = {"tags": ["weights", "kv_cache"]}


@pytest.fixture(scope="module")
def runtime(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerProcess, ScratchArena]]:
    arena = arena_for([kv_shape("llama-tiny", "bfloat16", "m")], 16, SLAB, num_slabs=24)
    join = dataclasses.replace(arena.join("m"), weights_in_arena=True)
    spec = ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--dtype", "bfloat16", "--page-size", "16", "--log-level", "warning"),
        env=join.environ())
    server = ServerProcess(spec, tmp_path_factory.mktemp("sleep") / "m.log")
    try:
        server.wait_healthy(300)
        yield server, arena
    finally:
        server.stop()
        host_copy_path(arena.fleet_id, "m").unlink(missing_ok=True)
        arena.close()


def _post(server: ServerProcess, path: str, body: dict[str, object]) -> None:
    reply = httpx.post(server.spec.base_url + path, json=body, timeout=120)
    assert reply.status_code == 200, (path, reply.status_code, reply.text)


def _held(arena: ScratchArena) -> dict[str, int]:
    return {o.runtime_id: o.num_slabs for o in snapshot(arena.arena.table).owners if o.alive}


def test_sleep_gives_weights_and_kv_back_and_wake_restores_identical_output(
        runtime: tuple[ServerProcess, ScratchArena]) -> None:
    server, arena = runtime
    before = [generate_http(server.spec.base_url, p, NEW_TOKENS) for p in PROMPTS]
    awake = _held(arena)
    assert awake["m:w"] >= 2 and awake["m"] >= 1, awake
    _post(server, "/pause_generation", {"mode": "retract"})
    _post(server, "/release_memory_occupation", TAGS)
    asleep = _held(arena)
    assert asleep.get("m:w", 0) == 0 and asleep.get("m", 0) == 0, asleep
    assert host_copy_path(arena.fleet_id, "m").stat().st_size > 0
    # A neighbour takes the slabs the weights had: the wake must land on others.
    shape = kv_shape("llama-tiny", "bfloat16", "n")
    neighbour = arena.arena.client("n", BlockFormat.unpadded(shape, 16))
    taken = neighbour.alloc(awake["m:w"] * neighbour.blocks_per_slab)
    try:
        _post(server, "/resume_memory_occupation", TAGS)
        _post(server, "/continue_generation", {})
        assert _held(arena)["m:w"] == awake["m:w"]
        after = [generate_http(server.spec.base_url, p, NEW_TOKENS) for p in PROMPTS]
        assert after == before, "greedy output after a wake equals the output before the sleep"
        settled_integrity(arena.arena.table)
    finally:
        neighbour.free(taken)
        neighbour.close()


def _cpu_seconds(pid: int, window_s: float) -> float:
    """CPU seconds that `pid` and its descendants used over `window_s` of wall time."""
    def total() -> float:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        seconds = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            seconds += times.user + times.system
        return seconds
    start = total()
    time.sleep(window_s)
    return total() - start


def test_the_cpu_measure_sees_a_spinning_process() -> None:
    """Control for the test below: a process that spins is seen spinning."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert _cpu_seconds(spinner.pid, 2.0) > 0.5, "a spinning process uses a core"
    finally:
        spinner.kill()
        spinner.wait()


def test_an_asleep_runtime_waits_on_its_sockets_instead_of_spinning(
        runtime: tuple[ServerProcess, ScratchArena]) -> None:
    # Found in a rehearsal of the suite: a paused SGLang scheduler turns its loop without
    # waiting, and five asleep runtimes took 30% of a core each, which slowed every test
    # after them 3-4x.
    server, arena = runtime
    _post(server, "/pause_generation", {"mode": "retract"})
    _post(server, "/release_memory_occupation", TAGS)
    try:
        time.sleep(1.0)  # the sleep's own work is done
        used = _cpu_seconds(server.proc.pid, 4.0)
        assert used < 0.8, f"an asleep runtime used {used:.2f} CPU seconds in 4 s"
    finally:
        start = time.monotonic()
        _post(server, "/resume_memory_occupation", TAGS)
        _post(server, "/continue_generation", {})
        woke = time.monotonic() - start
    assert woke < 5.0, f"a waiting scheduler answers the wake at once ({woke:.2f} s)"
    assert generate_http(server.spec.base_url, PROMPTS[0], NEW_TOKENS), "it serves again"
    settled_integrity(arena.arena.table)

"""Layer streaming on a real CPU SGLang server (issue #17): a llama-tiny runtime (4 decoder
layers, each on two 1 MiB slabs of its own) told through its stream request to lend layers.

For each S (empty; Select-N intervals 2 and 4, i.e. layers {1, 3} and {3}; Oneiros-style
evenly spaced lending of 1, 2 and 3 layers) and slot count, at pages 1 and 16: greedy output
equals the output with S empty, the arena's free slabs grow by exactly the bytes the runtime
reports lent (less its slots), and going back to S empty returns every one. Then SIGKILL with
layers lent: nothing leaks, and the slab table passes its integrity check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

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
from fineslab.slabs import check_integrity, snapshot
from fineslab.slabs.streamctl import (
    POLL_S,
    StreamState,
    host_copy_path,
    read_state,
    request_path,
    state_path,
    write_request,
)

pytestmark = pytest.mark.slow

PROMPTS = prompts(2, 24, seed=11)
NEW_TOKENS = 12
SLAB = 1 << 20
RUNTIME = "m"
#: (layers, slots): S empty, Select-N i=2 and i=4, Oneiros-style 1..3 evenly spaced layers.
CASES = [((), 1), ((1, 3), 1), ((3,), 1), ((0,), 1), ((0, 2), 1), ((0, 1, 2), 1),
         ((1, 3), 2)]


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def runtime(request: pytest.FixtureRequest, model_cache: Path,
            tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerProcess, ScratchArena]]:
    page = int(request.param)
    arena = arena_for([kv_shape("llama-tiny", "bfloat16", RUNTIME)], page, SLAB, num_slabs=24)
    join = dataclasses.replace(arena.join(RUNTIME), weights_in_arena=True,
                               layer_streaming=True)
    spec = ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
        "--dtype", "bfloat16", "--page-size", str(page), "--log-level", "warning"),
        env=join.environ())
    server = ServerProcess(spec, tmp_path_factory.mktemp("streaming") / f"m{page}.log")
    try:
        server.wait_healthy(300)
        yield server, arena
    finally:
        server.stop()
        for path in (host_copy_path(arena.fleet_id, RUNTIME),
                     request_path(arena.fleet_id, RUNTIME), state_path(arena.fleet_id, RUNTIME)):
            path.unlink(missing_ok=True)
        arena.close()


def _ask(arena: ScratchArena, layers: tuple[int, ...], slots: int) -> StreamState:
    """Write the request and wait until the runtime applied it."""
    request = write_request(arena.fleet_id, RUNTIME, layers, slots)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = read_state(arena.fleet_id, RUNTIME)
        if state is not None and state.seq == request.seq:
            return state
        time.sleep(0.02)
    raise AssertionError(f"the runtime did not apply stream request {request}")


def _free_slabs(arena: ScratchArena) -> int:
    return snapshot(arena.arena.table).free_slabs


def _greedy(server: ServerProcess) -> list[list[int]]:
    return [generate_http(server.spec.base_url, p, NEW_TOKENS) for p in PROMPTS]


def test_streamed_output_is_identical_and_the_gain_is_the_lent_bytes(
        runtime: tuple[ServerProcess, ScratchArena]) -> None:
    server, arena = runtime
    state = _ask(arena, (), 1)
    assert state.error is None and state.layers == []
    reference = _greedy(server)
    free_before = _free_slabs(arena)
    for layers, slots in CASES:
        state = _ask(arena, layers, slots)
        assert state.error is None and tuple(state.layers) == layers, state
        gained = (_free_slabs(arena) - free_before) * SLAB
        assert gained == state.net_lent_bytes, (layers, slots, gained, state)
        assert _greedy(server) == reference, f"greedy output with S={layers}, {slots} slot(s)"
        time.sleep(4 * POLL_S)  # the runtime publishes its counters within POLL_S
        state = read_state(arena.fleet_id, RUNTIME)
        assert state is not None and state.passes > 0
        if len(layers) > slots:
            assert state.streamed_bytes_last_pass > 0, "layers were copied in during the pass"
    state = _ask(arena, (), 1)
    assert _free_slabs(arena) == free_before, "reversion returns every lent slab"
    assert state.lent_bytes == 0 and state.slot_bytes == 0
    assert 0 < state.decode_passes < state.passes, (
        "decode passes are timed, prefill passes are not", state)
    assert 0 < state.decode_compute_s < 5, state
    assert _greedy(server) == reference
    settled_integrity(arena.arena.table)


def test_a_request_the_model_cannot_take_is_refused_and_it_serves_on(
        runtime: tuple[ServerProcess, ScratchArena]) -> None:
    server, arena = runtime
    reference = _greedy(server)
    state = _ask(arena, (0, 1, 2, 3), 1)
    assert state.error is not None and "stays resident" in state.error
    state = _ask(arena, (9,), 1)
    assert state.error is not None and "do not exist" in state.error
    request_path(arena.fleet_id, RUNTIME).write_text("{not json")
    time.sleep(0.3)
    assert _greedy(server) == reference, "a bad request changes nothing"
    assert server.tree_intact(), "the runtime is still up"


def test_sigkill_with_layers_lent_leaks_nothing(
        runtime: tuple[ServerProcess, ScratchArena]) -> None:
    server, arena = runtime
    state = _ask(arena, (1, 3), 1)
    assert state.lent_bytes > 0
    _greedy(server)
    for pid in server.tree_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.tree_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    arena.arena.table.reclaim_dead_owners()
    assert arena.used_bytes().get(RUNTIME, 0) == 0
    assert all(not o.runtime_id.startswith(RUNTIME) for o in snapshot(arena.arena.table).owners
               if o.alive), "no slab held for the dead runtime, weights and slots included"
    assert _free_slabs(arena) == arena.arena.table.dims.num_slabs
    check_integrity(arena.arena.table)

"""The cache squeeze end to end: real SGLang servers on CPU in one arena, radix caches on, no
launcher (so no reclaim rounds: only the runtimes themselves can give memory back).

Runtime "a" (llama-tiny, BF16 KV, 3 blocks a slab) shares a 24-slab arena with two qwen2-tiny
runtimes (FP16 KV, 4 blocks a slab): "off" runs with FINESLAB_CACHE_SQUEEZE=0, "on" with the
default. Each of them in turn fills the arena with its cached prefixes (four finished requests
of five slabs each); then "a" asks for more than the free slabs.

    control  "off" holds the cache: a's request waits (8 s here; for ever without a flush),
             and a /flush_cache of "off" lets it through, so memory was all it waited for
    squeeze  "on" holds the cache: a's request is answered in seconds with nobody flushing,
             "on" evicted its least recently used prefixes only, and a's output is the same
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from plugin_test_support import ScratchArena, arena_for, generate_http, kv_shape, prompts

from fineslab.env import CACHE_SQUEEZE_VAR
from fineslab.runtime import ServerProcess, ServerSpec, free_port

pytestmark = pytest.mark.slow

PAGE = 16
SLAB_BYTES = 96 << 10
NUM_SLABS = 24
MODELS = {"a": ("llama-tiny", "bfloat16"), "off": ("qwen2-tiny", "float16"),
          "on": ("qwen2-tiny", "float16")}
B_SLAB_TOKENS = 4 * PAGE
FILL = {rid: prompts(4, 300, seed=seed) for rid, seed in (("off", 31), ("on", 32))}
ASK = prompts(1, 250, seed=33)[0]  # 17 pages of "a" with its 8 new tokens: 6 of its slabs
NEW_TOKENS = 8
CONTROL_WAIT_S = 8.0


@pytest.fixture(scope="module")
def fleet(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[dict[str, ServerProcess], ScratchArena]]:
    arena = arena_for([kv_shape(m, d, rid) for rid, (m, d) in MODELS.items()], PAGE,
                      SLAB_BYTES, NUM_SLABS)
    logs = tmp_path_factory.mktemp("squeeze-logs")
    servers: dict[str, ServerProcess] = {}
    try:
        for rid, (model, dtype) in MODELS.items():
            env = arena.join(rid).environ()
            if rid == "off":
                env[CACHE_SQUEEZE_VAR] = "0"
            spec = ServerSpec(str(model_cache / model), free_port(), extra_args=(
                "--dtype", dtype, "--page-size", str(PAGE), "--log-level", "info"), env=env)
            servers[rid] = ServerProcess(spec, logs / f"{rid}.log")
        for server in servers.values():
            server.wait_healthy(300)
        yield servers, arena
    finally:
        for server in servers.values():
            server.stop()
        arena.close()


def _fill(servers: dict[str, ServerProcess], arena: ScratchArena, rid: str) -> int:
    """Four finished requests left in `rid`'s radix cache; returns the slabs it holds (the
    parked padding slab among them, when it drew first). At most 4 slabs stay free: fewer
    than the 6 a's request needs."""
    for prompt in FILL[rid]:
        generate_http(servers[rid].spec.base_url, prompt, NEW_TOKENS, timeout_s=120)
    held = arena.used_bytes().get(rid, 0) // SLAB_BYTES
    free = arena.arena.table.free_slab_count()
    assert held >= 18 and free <= 4, (
        f"{rid}'s cache must fill the arena, else this tests nothing: it holds {held} slabs, "
        f"{free} are free")
    return held


def _ask(servers: dict[str, ServerProcess]) -> tuple[threading.Thread, list[object]]:
    """a's request, on a thread: its answer (or error) lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(generate_http(servers["a"].spec.base_url, ASK, NEW_TOKENS,
                                     timeout_s=180))
        except Exception as exc:  # reported by the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _flush(servers: dict[str, ServerProcess], rid: str) -> None:
    assert httpx.post(servers[rid].spec.base_url + "/flush_cache", timeout=30).status_code == 200


def test_a_busy_arenas_cached_prefixes_come_back_to_a_waiting_request_only_when_squeezed(
        fleet: tuple[dict[str, ServerProcess], ScratchArena]) -> None:
    servers, arena = fleet
    # The control: the cache's holder does not take part.
    _fill(servers, arena, "off")
    thread, out = _ask(servers)
    thread.join(CONTROL_WAIT_S)
    assert not out, (f"control: with the holder's squeeze off, a's request must wait for the "
                     f"memory; it got {out}")
    _flush(servers, "off")
    thread.join(120)
    assert out and isinstance(out[0], list), f"after the flush a's request is answered: {out}"
    alone = out[0]
    for rid in ("a", "off"):
        _flush(servers, rid)

    # The squeeze: the same request, the cache now "on"'s.
    held = _fill(servers, arena, "on")
    start = time.monotonic()
    thread, out = _ask(servers)
    thread.join(60)
    waited = time.monotonic() - start
    assert out and isinstance(out[0], list), f"a's request must be answered: {out}"
    assert out[0] == alone, "the same greedy answer as with a flushed arena"
    kept = arena.used_bytes().get("on", 0) // SLAB_BYTES
    assert kept >= held - 10, (f'"on" must give back what a needed, not its whole cache: it '
                               f"held {held} slabs and kept {kept}")
    log = Path(servers["on"].log_path or "").read_text()
    assert "a neighbour's request needs" in log, "the eviction is logged"
    print(f"\nsqueezed: a answered after {waited:.1f} s; \"on\" kept {kept} of {held} slabs")

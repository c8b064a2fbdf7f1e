"""Requests at and over a runtime's token budget get the same answers from the slab pool as from
SGLang's own pool (issue #35, finding 1).

Two real CPU servers of llama-tiny, page 16, `--max-total-tokens 256`: SGLang's own pool, and
the plugin's pool in an arena. SGLang refuses a prompt over its longest input (250 tokens) with a
400 and clips each request's new tokens to what its budget holds once the prompt's pages and one
more are taken (256 - 16 x ceil(n / 16) - 17: none from 225 prompt tokens on). A prompt whose
pages fill the budget (241-250 tokens) is never admitted, by either pool: SGLang queues it for
ever, which is why the router refuses every request its runtimes' budget cannot hold
(`TokenBudget`, tests/serving/test_router_hardening.py). Each request goes to both pools with a
bound (a client that gives up aborts its request in SGLang); the answers must be the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_test_support import ScratchArena, arena_for, kv_shape, prompts

from fineslab.runtime import ServerProcess, ServerSpec, free_port

pytestmark = pytest.mark.slow

BUDGET = 256
PAGE = 16
#: Prompt lengths around the budget's edges: over the longest input SGLang takes (251), pages
#: that fill the budget (241), clipped to no token (225), the last with room for one (224).
LENGTHS = (251, 241, 225, 224, 100)
#: A 250-token prefill of llama-tiny takes well under a second, on a loaded machine too.
ANSWER_S = 15.0


@pytest.fixture(scope="module")
def servers(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, ServerProcess]]:
    folder = tmp_path_factory.mktemp("budget")
    arena: ScratchArena = arena_for([kv_shape("llama-tiny", "bfloat16", "m")], PAGE, 1 << 20,
                                    num_slabs=8)
    args = ("--dtype", "bfloat16", "--page-size", str(PAGE), "--max-total-tokens", str(BUDGET),
            "--log-level", "warning")
    model = str(model_cache / "llama-tiny")
    started: dict[str, ServerProcess] = {}
    try:
        started["sglang"] = ServerProcess(ServerSpec(model, free_port(), extra_args=args),
                                          folder / "sglang.log")
        started["slabs"] = ServerProcess(ServerSpec(model, free_port(), extra_args=args,
                                                    env=arena.join("m").environ()),
                                         folder / "slabs.log")
        for server in started.values():
            server.wait_healthy(300)
        yield started
    finally:
        for server in started.values():
            server.stop()
        arena.close()


def _answer(server: ServerProcess, input_ids: list[int]) -> tuple[Any, ...]:
    """(status, new tokens, finish reason) of one greedy request; a timeout fails the test."""
    try:
        reply = httpx.post(server.spec.base_url + "/generate", timeout=ANSWER_S, json={
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}})
    except httpx.TimeoutException:
        return ("no answer", f"within {ANSWER_S:.0f} s")
    if reply.status_code != 200:
        return (reply.status_code,)
    body = reply.json()
    return (200, len(body["output_ids"]), body["meta_info"]["finish_reason"]["type"])


def test_requests_over_the_budget_get_the_answers_sglangs_own_pool_gives(
        servers: dict[str, ServerProcess]) -> None:
    answers: dict[str, dict[int, tuple[Any, ...]]] = {name: {} for name in servers}
    for length in LENGTHS:
        ids = prompts(1, length, seed=length)[0]
        for name, server in servers.items():
            answers[name][length] = _answer(server, ids)
    assert answers["slabs"] == answers["sglang"], answers
    stock = answers["sglang"]
    # What SGLang's own pool answers, so the comparison is of the budget's edges, not of two
    # pools that agree on nothing in particular.
    assert stock[251] == (400,), stock
    assert stock[241][0] == "no answer", stock
    assert stock[225] == (200, 0, "length"), stock
    assert stock[224] == (200, 256 - 224 - PAGE - 1, "length"), stock
    assert stock[100] == (200, 24, "length"), stock

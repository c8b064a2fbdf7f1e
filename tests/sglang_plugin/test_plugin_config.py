"""Bad configuration stops a runtime at start-up with a clear error; no silent fallback.

The six start-up failures run as real SGLang servers, started together to share the wait. What
needs no model is refused by the launching process before SGLang starts the scheduler (three of
them: seconds, not a model load); the other two by the scheduler.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_test_support import ScratchArena, arena_for, kv_shape

from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin import ArenaJoin, Contact, Kind, check_contacts, install, register
from fineslab.sglang_plugin.config import TESTED_SGLANG_VERSION
from fineslab.sglang_plugin.link import ArenaLink, fit_to_arena
from fineslab.sglang_plugin.refusals import refuse_unsupported
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.views import layer_views

#: case -> (dtype, flags, what the error names, refused before SGLang starts the scheduler)
BAD_STARTS = {
    # One slab of exactly one 16-token llama block: nothing left once page 0 is set aside.
    "too_small": ("bfloat16", (), "arena too small", True),
    # float32 KV has no slab block format (the model's KV dtype is the scheduler's to derive).
    "unknown_format": ("float32", (), "unknown model format", False),
    # HiCache copies contiguous per-layer buffers: refused by name.
    "unsupported_flag": ("bfloat16", ("--enable-hierarchical-cache",),
                         "--enable-hierarchical-cache", True),
    # Issue #16: weights asked into an arena of 3 slabs (llama-tiny needs more).
    "weights_do_not_fit": ("bfloat16", (), "do not fit the arena", False),
    # Issue #20: the lent tier asked for (FINESLAB_PREFIX_LENDING) on SGLang's own radix cache.
    "lent_tier_without_backend": ("bfloat16", (), "--radix-cache-backend fineslab_lent", True),
    # Issue #37: the runtime contract plans float16 KV; SGLang builds bfloat16 (--dtype).
    "plan_differs": ("bfloat16", (), "but the plan is 4 layers x", False),
}
EARLY = "refused before SGLang started the scheduler"


@pytest.fixture(scope="module")
def failed_logs(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("bad")
    shape = kv_shape("llama-tiny", "bfloat16", "m")
    arenas = {
        "too_small": ScratchArena.create(16 * 2048, 1, 1),
        "unknown_format": arena_for([shape], 16, 1 << 20, 2),
        "unsupported_flag": arena_for([shape], 16, 1 << 20, 2),
        "weights_do_not_fit": arena_for([shape], 16, 1 << 20, 3),
        "lent_tier_without_backend": arena_for([shape], 16, 1 << 20, 4),
        "plan_differs": arena_for([shape], 16, 1 << 20, 2),
    }
    servers = {}
    for case, (dtype, flags, _, _) in BAD_STARTS.items():
        join = dataclasses.replace(
            arenas[case].join("m"), weights_in_arena=case == "weights_do_not_fit",
            prefix_lending=2 if case == "lent_tier_without_backend" else None)
        env = join.environ()
        if case == "plan_differs":
            planned = BlockFormat.unpadded(kv_shape("llama-tiny", "float16", "m"), 16)
            path = join.contract("cpu", planned).write(logs / "m.contract.json")
            env = {"FINESLAB_CONTRACT": str(path)}
        spec = ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=(
            "--dtype", dtype, "--page-size", "16", *flags), env=env)
        servers[case] = ServerProcess(spec, logs / f"{case}.log")
    texts = {}
    try:
        for case, server in servers.items():
            with pytest.raises(EnvironmentSetupError):
                server.wait_healthy(300)
            texts[case] = server.log_tail(200)
            # fineslab's own refusal is the same in a plain start: not tried twice
            texts[case + ":start"] = server.start_kind
    finally:
        for server in servers.values():
            server.stop()
        for arena in arenas.values():
            arena.close()
    yield texts


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_STARTS))
def test_bad_configuration_fails_start_up_with_clear_error(failed_logs: dict[str, str],
                                                          case: str) -> None:
    _, _, expected, early = BAD_STARTS[case]
    assert "ConfigError" in failed_logs[case] and expected in failed_logs[case], (
        f"{case}: start-up must fail naming the problem ({expected!r}); log:\n"
        + failed_logs[case][-3000:])
    assert (EARLY in failed_logs[case]) == early, (
        f"{case}: {'the launching process' if early else 'the scheduler'} must refuse it "
        f"(what needs no model is refused before SGLang starts the scheduler); log:\n"
        + failed_logs[case][-3000:])
    assert failed_logs[case + ":start"] != "plain-after-warm", \
        "a configuration fineslab refuses was started again plainly"


def test_missing_hook_names_the_sglang_version() -> None:
    configurator = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
    missing = Contact(f"{configurator}._no_such_method", Kind.METHOD, "test",
                      hook="profile_available_bytes")
    renamed = Contact(f"{configurator}._profile_available_bytes", Kind.METHOD, "test",
                      ("gone",), hook="profile_available_bytes")
    import sglang

    for target in (missing, renamed):
        with pytest.raises(EnvironmentSetupError) as err:
            check_contacts([target])
        assert sglang.__version__ in str(err.value) and TESTED_SGLANG_VERSION in str(err.value)
        with pytest.raises(EnvironmentSetupError):
            install(ArenaJoin("never-opened", "m"), [target])
    check_contacts()  # every real contact holds in this SGLang


def test_half_set_join_stops_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINESLAB_ARENA", "some-fleet")
    monkeypatch.delenv("FINESLAB_RUNTIME_ID", raising=False)
    with pytest.raises(ConfigError, match="FINESLAB_RUNTIME_ID"):
        ArenaJoin.from_env(FineslabEnv.from_environ())
    # SGLang swallows Exceptions raised by plugins; SystemExit gets through.
    with pytest.raises(SystemExit, match="FINESLAB_RUNTIME_ID"):
        register()


def test_no_join_means_no_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FINESLAB_ARENA", "FINESLAB_RUNTIME_ID"):
        monkeypatch.delenv(var, raising=False)
    assert ArenaJoin.from_env(FineslabEnv.from_environ({})) is None
    register()  # returns at once: nothing to join
    assert os.environ.get("FINESLAB_ARENA") is None


def test_refusals_name_every_unsupported_setting() -> None:
    refuse_unsupported({"speculative_algorithm": None, "disaggregation_mode": "null",
                        "tp_size": 1, "enable_hierarchical_cache": False})
    with pytest.raises(ConfigError) as err:
        refuse_unsupported({"speculative_algorithm": "EAGLE", "tp_size": 2,
                            "enable_memory_saver": True, "disaggregation_mode": "prefill"})
    for flag in ("--speculative-algorithm", "--tp-size", "--enable-memory-saver",
                 "--disaggregation-mode"):
        assert flag in str(err.value), f"the refusal must name {flag}"


def test_capacity_leaves_out_the_padding_slab() -> None:
    """SGLang's capacity is every slab but slab 0 (the padding slab, never KV); an arena of one
    slab leaves nothing and stops start-up.

        4 slabs x 32 blocks of 16 tokens (llama-tiny, BF16): capacity 3 x 32 x 16 = 1,536
    """
    shape = kv_shape("llama-tiny", "bfloat16", "m")
    with pytest.raises(ConfigError, match="arena too small"):
        fit_to_arena(shape, 1 << 20, 1 << 20, 16)
    arena = arena_for([shape], 16, 1 << 20, 4)
    try:
        fmt = fit_to_arena(shape, 1 << 20, arena.arena_bytes, 16)
        source = arena.arena.client("m", fmt)
        link = ArenaLink(arena.arena, fmt, layer_views(arena.arena.tensor(), fmt),  # type: ignore[arg-type]
                         source)
        assert fmt.blocks_per_slab(1 << 20) == 32
        assert link.capacity_tokens == 3 * 32 * 16, "every slab but the padding slab"
        assert link.num_slots - link.capacity_tokens >= fmt.tokens_per_block, \
            "SGLang's views need capacity + one page of rows"
        rows = link.page_bytes()
        assert tuple(rows.shape) == (4 * 32, fmt.block_stride_bytes), "one row a page"
        source.close()
    finally:
        arena.close()

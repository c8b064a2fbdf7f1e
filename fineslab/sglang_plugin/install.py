"""Installing the plugin into SGLang: the hook targets, the version check, and the two doors.

Two ways in, one code path:

- `register()`: the entry point of group `sglang.srt.plugins`, which SGLang calls in every
  process it starts (engine, scheduler, detokenizer). It reads the join request from the
  environment and does nothing when there is none.
- `install(join)`: for a custom SGLang build or an embedding program; call it in the process that
  builds the KV pool (the scheduler) before the pool is built.

SGLang runs plugin entry points under `except Exception` and only logs what they raise, and it
only logs hooks that fail to apply. A runtime told to join an arena must never fall back to its
own pool silently, so `register()` turns every failure into `SystemExit` (which that handler
does not catch): the process stops at start-up with the message.
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fineslab.errors import ConfigError, EnvironmentSetupError, FineslabError
from fineslab.sglang_plugin.config import TESTED_SGLANG_VERSION, ArenaJoin

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


@dataclass(frozen=True)
class HookTarget:
    """A method the plugin wraps, the session method that wraps it, and the parameters the
    wrapper relies on (a renamed parameter means another SGLang and must stop start-up)."""

    path: str
    session_method: str
    parameters: tuple[str, ...]


HOOK_TARGETS: tuple[HookTarget, ...] = (
    HookTarget(f"{_CONFIGURATOR}._profile_available_bytes", "profile_available_bytes",
               ("pre_model_load_memory",)),
    HookTarget(f"{_CONFIGURATOR}._resolve_kv_pool_class", "resolve_kv_pool_class",
               ("kind", "default")),
    HookTarget(f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", "build_allocator",
               ("sizes", "token_to_kv_pool", "token_to_kv_pool_allocator")),
    HookTarget(f"{_CHECKER}._check_full_pool", "check_full_pool", ("ps", "uncached")),
    HookTarget(f"{_SCHEDULER}._get_new_batch_prefill_raw", "new_batch_prefill",
               ("prefill_delayer_single_pass", "running_batch")),
)


def sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def check_hooks(targets: Sequence[HookTarget] = HOOK_TARGETS) -> None:
    """Raise EnvironmentSetupError naming the SGLang version if a target or parameter is missing."""
    problems = []
    for target in targets:
        try:
            function = pkgutil.resolve_name(target.path)
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"{target.path}: missing ({type(exc).__name__}: {exc})")
            continue
        params = inspect.signature(function).parameters
        absent = [p for p in target.parameters if p not in params]
        if absent:
            problems.append(f"{target.path}: no parameter(s) {absent}")
    if problems:
        raise EnvironmentSetupError(
            f"fineslab's SGLang plugin cannot hook SGLang {sglang_version()} (written for "
            f"{TESTED_SGLANG_VERSION}); refusing to start rather than fall back to SGLang's own "
            "KV pool:\n  " + "\n  ".join(problems))


def apply_session_hooks(session: object, targets: Sequence[HookTarget]) -> None:
    """Register `session`'s wrappers as AROUND hooks on `targets` and patch SGLang with them.

    SGLang's registry only logs a hook that fails to apply, which would leave the runtime on its
    own KV pool; so this checks every target was patched and raises EnvironmentSetupError naming
    the SGLang version and each target that was not.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in targets:
        hook: Callable[..., object] = getattr(session, target.session_method)
        HookRegistry.register(target.path, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    unapplied = [t.path for t in targets if t.path not in HookRegistry._patched]
    if unapplied:
        raise EnvironmentSetupError(
            f"fineslab plugin: SGLang {sglang_version()} (written for {TESTED_SGLANG_VERSION}) "
            f"did not apply hooks on {unapplied}; refusing to start rather than fall back to "
            "SGLang's own KV pool")


def install(join: ArenaJoin, targets: Sequence[HookTarget] = HOOK_TARGETS) -> object:
    """Make this process's SGLang keep its KV in the arena `join` names; returns the session.

    Registers AROUND hooks with SGLang's HookRegistry and applies them at once. Raises
    EnvironmentSetupError if this SGLang lacks a hook target or does not apply one. Idempotent
    per process only in the sense SGLang's registry is: call it once.
    """
    from fineslab.sglang_plugin.hooks import PluginSession

    check_hooks(targets)
    version = sglang_version()
    if version != TESTED_SGLANG_VERSION:
        logger.warning("fineslab plugin: SGLang %s, tested on %s; hooks resolve, continuing",
                       version, TESTED_SGLANG_VERSION)
    session = PluginSession(join)
    apply_session_hooks(session, targets)
    logger.info("fineslab plugin: runtime %r will keep its KV in arena %r",
                join.runtime_id, join.arena_name)
    return session


def register() -> None:
    """Entry point of `sglang.srt.plugins`: join the arena named in the environment, if any.

    A quantized KV format named by FINESLAB_KV_FORMAT (KV4, scaled FP8) gets its own pool
    (`quant_session`); otherwise the runtime gets the plain slab pool.
    """
    try:
        join = ArenaJoin.from_env()
        if join is None:
            return
        from fineslab.sglang_plugin.quant_session import KVFormatRequest, install_quant

        request = KVFormatRequest.from_env()
        if request is None:
            install(join)
        else:
            install_quant(join, request)
    except FineslabError as exc:
        logger.critical("%s", exc)
        raise SystemExit(f"fineslab SGLang plugin: {exc}") from exc


__all__ = ["HOOK_TARGETS", "ConfigError", "HookTarget", "apply_session_hooks", "check_hooks",
           "install", "register"]

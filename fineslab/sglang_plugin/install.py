"""Installing the plugin into SGLang: the contact check, the hooks, and the two doors.

Two ways in, one code path (`install_session`):

- `register()`: the entry point of group `sglang.srt.plugins`, which SGLang calls in every
  process it starts (engine, scheduler, detokenizer). It reads the join request from the
  environment and does nothing when there is none.
- `install(join)`: for a custom SGLang build or an embedding program; call it in the process that
  builds the KV pool (the scheduler) before the pool is built. A quantized KV format is part of
  the join (`ArenaJoin(..., kv_format=KVDtype.INT4)`), not another door.

Both first check every SGLang name a runtime in an arena relies on
(`contact.ARENA_CONTACTS`, checked by `contact_check`; the QoQ method's names only where it is
registered), then register the AROUND hooks (`contact.HOOK_TARGETS`) and verify SGLang applied
each. SGLang runs plugin entry points under `except Exception` and only logs what they raise,
and it only logs hooks that fail to apply. A runtime told to join an arena must never fall back
to its own pool silently, so `register()` turns every failure into `SystemExit` (which that
handler does not catch): the process stops at start-up with the message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fineslab.errors import ConfigError, EnvironmentSetupError, FineslabError
from fineslab.quant.kv4 import KV4_ATTENTION_BACKEND
from fineslab.quant.qoq_checkpoint import QUANT_METHOD
from fineslab.sglang_plugin.config import (
    LENT_RADIX_BACKEND,
    TESTED_SGLANG_VERSION,
    ArenaJoin,
    EngineSchedule,
)
from fineslab.sglang_plugin.contact import (
    ARENA_CONTACTS,
    ENGINE_POLICY_CONTACTS,
    HOOK_TARGETS,
    KV4_BACKEND_CONTACTS,
    QOQ_CONTACTS,
    SCHEDULING_CONTACTS,
    Contact,
)
from fineslab.sglang_plugin.contact_check import check_contacts, sglang_version
from fineslab.sglang_plugin.gloo_device import share_single_rank_devices

if TYPE_CHECKING:
    from fineslab.sglang_plugin.engine_policy import SchedulingSession
    from fineslab.sglang_plugin.hooks import PluginSession

logger = logging.getLogger(__name__)

Session = TypeVar("Session", "PluginSession", "SchedulingSession")


def apply_session_hooks(session: object, targets: Sequence[Contact]) -> None:
    """Register `session`'s wrappers as AROUND hooks on `targets` and patch SGLang with them.

    SGLang's registry only logs a hook that fails to apply, which would leave the runtime on its
    own KV pool; so this checks every target was patched and raises EnvironmentSetupError naming
    the SGLang version and each target that was not.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in targets:
        assert target.hook is not None, f"{target.path} is not a hook target"
        hook: Callable[..., object] = getattr(session, target.hook)
        HookRegistry.register(target.path, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    unapplied = [t.path for t in targets if t.path not in HookRegistry._patched]
    if unapplied:
        raise EnvironmentSetupError(
            f"fineslab plugin: SGLang {sglang_version()} (written for {TESTED_SGLANG_VERSION}) "
            f"did not apply hooks on {unapplied}; refusing to start rather than fall back to "
            "SGLang's own KV pool")


def install_session(session: Session, contacts: Sequence[Contact] = ARENA_CONTACTS) -> Session:
    """Check `contacts`, then install `session`'s hooks on those of them that are hook targets.

    Raises EnvironmentSetupError naming the SGLang version if a contact broke or SGLang did not
    apply a hook. Call it once per process: SGLang's registry is process-wide.
    """
    check_contacts(contacts)
    version = sglang_version()
    if version != TESTED_SGLANG_VERSION:
        logger.warning("fineslab plugin: SGLang %s, tested on %s; every contact point holds, "
                       "continuing", version, TESTED_SGLANG_VERSION)
    apply_session_hooks(session, [c for c in contacts if c.hook is not None])
    return session


def install(join: ArenaJoin, contacts: Sequence[Contact] = ARENA_CONTACTS,
            schedule: EngineSchedule | None = None) -> PluginSession:
    """Make this process's SGLang keep its KV in the arena `join` names (and, with `schedule`,
    pick its prefill batches by the local scheduler's policy); returns the session."""
    from fineslab.sglang_plugin.engine_policy import EngineBatchPolicy
    from fineslab.sglang_plugin.hooks import PluginSession

    engine = None
    if schedule is not None:
        check_contacts(ENGINE_POLICY_CONTACTS)
        engine = EngineBatchPolicy(schedule)
        _log_schedule(schedule)
    session = install_session(PluginSession(join, engine=engine), contacts)
    if join.prefix_lending is not None:
        from sglang.srt.mem_cache.registry import register_radix_cache_backend

        from fineslab.sglang_plugin.contact import PREFIX_TIER_CONTACTS

        check_contacts(PREFIX_TIER_CONTACTS)
        register_radix_cache_backend(LENT_RADIX_BACKEND, session.tree_cache)
    logger.info("fineslab plugin: runtime %r will keep its %sKV in arena %r", join.runtime_id,
                "" if join.kv_format is None else f"{join.kv_format.config_name} ",
                join.arena_name)
    return session


def install_scheduling(schedule: EngineSchedule) -> SchedulingSession:
    """The engine policy alone, in a runtime that keeps SGLang's own KV pool."""
    from fineslab.sglang_plugin.engine_policy import EngineBatchPolicy, SchedulingSession

    session = install_session(SchedulingSession(EngineBatchPolicy(schedule)), SCHEDULING_CONTACTS)
    _log_schedule(schedule)
    return session


def _log_schedule(schedule: EngineSchedule) -> None:
    logger.info("fineslab plugin: prefill batches chosen by %r (TTFT SLO %g s unless the "
                "request carries a deadline)", schedule.policy, schedule.ttft_slo_s)


#: Set to 1 to register the `fineslab_qoq` quantization method whatever the model (an
#: in-process engine, whose argv names no model).
QOQ_ENV = "FINESLAB_QOQ"


def wants_qoq(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this SGLang process needs the `fineslab_qoq` method: FINESLAB_QOQ=1, or the
    `--model-path` on its command line (SGLang's spawned processes inherit it) is a checkpoint
    whose config.json says `quant_method: fineslab_qoq`. Registering imports SGLang's layer
    modules (about 5 s of CPU), which a detokenizer or a stock runtime should not pay."""
    if environ.get(QOQ_ENV) == "1":
        return True
    for flag in ("--model-path", "--model"):
        if flag in argv[:-1]:
            config = Path(argv[argv.index(flag) + 1]) / "config.json"
            try:
                quant = json.loads(config.read_text()).get("quantization_config") or {}
            except (OSError, ValueError, AttributeError):
                return False
            return isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD
    return False


#: Set to 1 to register the `fineslab_kv4` attention backend whatever the command line (an
#: in-process engine, whose argv names no backend).
KV4_BACKEND_ENV = "FINESLAB_KV4_BACKEND"
#: The flags that name an attention backend (prefill and decode may name their own).
_BACKEND_FLAGS = ("--attention-backend", "--decode-attention-backend",
                  "--prefill-attention-backend")


def wants_kv4_backend(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this SGLang process needs the `fineslab_kv4` attention backend: the variable
    FINESLAB_KV4_BACKEND=1, or a backend flag on its command line (which SGLang's spawned
    processes inherit) names it. Registering imports SGLang's attention modules, which a
    detokenizer or a stock runtime should not pay for."""
    if environ.get(KV4_BACKEND_ENV) == "1":
        return True
    named = {f"{flag}={KV4_ATTENTION_BACKEND}" for flag in _BACKEND_FLAGS}
    return any(arg in named or (arg in _BACKEND_FLAGS and value == KV4_ATTENTION_BACKEND)
               for arg, value in zip(argv, [*argv[1:], ""], strict=True))


def register() -> None:
    """Entry point of `sglang.srt.plugins`: register the `fineslab_qoq` quantization method
    (`qoq_method.py`) where the model needs it (`wants_qoq`) and the `fineslab_kv4` attention
    backend (`kv4_backend.py`) where the command line names it (`wants_kv4_backend`), then join
    the arena named in the environment, if any.

    A quantized KV format named by FINESLAB_KV_FORMAT (KV4, scaled FP8) is part of the join
    (`ArenaJoin.kv_format`): the same session, with the quantized pool. An engine schedule
    (FINESLAB_ENGINE_POLICY) rides on the join's session, or gets one of its own without a join.
    In every SGLang process it loads in, single-rank gloo groups share one device
    (`gloo_device.py`: one loop thread where a tp=1 scheduler had nine).
    """
    share_single_rank_devices()
    try:
        if wants_qoq(sys.argv, os.environ):
            from fineslab.sglang_plugin.qoq_method import register_qoq_method

            check_contacts(QOQ_CONTACTS)
            register_qoq_method()
        if wants_kv4_backend(sys.argv, os.environ):
            from fineslab.sglang_plugin.kv4_backend import register_kv4_backend

            check_contacts(KV4_BACKEND_CONTACTS)
            register_kv4_backend()
        join = ArenaJoin.from_env()
        schedule = EngineSchedule.from_env()
        if join is not None:
            install(join, schedule=schedule)
        elif schedule is not None:
            install_scheduling(schedule)
    except FineslabError as exc:
        logger.critical("%s", exc)
        raise SystemExit(f"fineslab SGLang plugin: {exc}") from exc


__all__ = ["HOOK_TARGETS", "ConfigError", "apply_session_hooks", "install", "install_session",
           "register"]

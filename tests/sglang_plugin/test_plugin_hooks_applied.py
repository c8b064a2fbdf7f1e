"""`install`, with the plain pool or a quantized KV format, stops when SGLang does not apply a hook.

SGLang's `HookRegistry.apply_hooks` only logs a target it fails to patch; a runtime that goes on
would keep its KV in SGLang's own pool while the router counts it in the arena. Each test runs
on an empty registry (restored afterwards) so no hook reaches the real SGLang classes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import sglang
from sglang.srt.plugins.hook_registry import HookRegistry

from fineslab.errors import EnvironmentSetupError
from fineslab.sglang_plugin import HOOK_TARGETS, ArenaJoin, install
from fineslab.sglang_plugin.config import TESTED_SGLANG_VERSION
from fineslab.slabs.formats import KVDtype

JOIN = ArenaJoin("never-opened", "m")
DOORS: dict[str, Callable[[], object]] = {
    "install": lambda: install(JOIN),
    "install_kv4": lambda: install(ArenaJoin("never-opened", "m", kv_format=KVDtype.INT4)),
}


@pytest.fixture
def empty_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())


@pytest.mark.usefixtures("empty_registry")
@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_hook_sglang_does_not_apply_stops_installation(monkeypatch: pytest.MonkeyPatch,
                                                         door: str) -> None:
    monkeypatch.setattr(HookRegistry, "apply_hooks", classmethod(lambda cls: None))
    with pytest.raises(EnvironmentSetupError) as err:
        DOORS[door]()
    message = str(err.value)
    assert sglang.__version__ in message and TESTED_SGLANG_VERSION in message, \
        "the error names the running and the tested SGLang"
    for target in HOOK_TARGETS:
        assert target.path in message, f"the error names the unapplied {target.path}"


@pytest.mark.usefixtures("empty_registry")
@pytest.mark.parametrize("door", sorted(DOORS))
def test_only_the_target_left_unpatched_is_named(monkeypatch: pytest.MonkeyPatch,
                                                 door: str) -> None:
    """SGLang applies every target but one (as when one raises inside `_apply_target`)."""
    skipped = HOOK_TARGETS[-1].path

    def apply_all_but_one(cls: type[HookRegistry]) -> None:
        cls._patched.update(t for t in cls._hooks if t != skipped)

    monkeypatch.setattr(HookRegistry, "apply_hooks", classmethod(apply_all_but_one))
    with pytest.raises(EnvironmentSetupError) as err:
        DOORS[door]()
    assert skipped in str(err.value), "the unapplied target is named"
    for target in HOOK_TARGETS[:-1]:
        assert target.path not in str(err.value), f"{target.path} was applied: not named"

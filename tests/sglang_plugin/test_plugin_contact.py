"""The contact table (`contact.py`): the installed SGLang passes it, a broken one fails loudly,
and the table lists every SGLang name the plugin's source touches.

No runtime: imports, signatures and sources only (a few seconds, most of it importing SGLang).

How the completeness scan works, and how to keep it complete: it parses every plugin module and
collects (1) names imported from `sglang...`, (2) `sglang.` strings outside docstrings, (3) in
each plugin class deriving from an SGLang class, every method that overrides an SGLang method
and every `self.X` / `super().X` that SGLang's base defines or mentions, (4) attributes read
(or set through `dataclasses.replace`) on SGLang objects that the hooks receive, by the variable
names in TYPED_NAMES (and the two indirections in CHAINED_NAMES). Each must be a row of
CONTACTS. When plugin code reaches an SGLang object through a new variable name (a new hook
parameter, a local holding an SGLang object), add the name to TYPED_NAMES with the object's
class; `grep -nE "\\b(name)\\.[a-z_]+" fineslab/sglang_plugin/*.py` then shows what it
touches. Names the plugin reads from a list (the refused ServerArgs settings) get their rows
from that list (`refusals.REFUSALS`), and the test checks each has one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import sglang
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

import fineslab.sglang_plugin as plugin
from fineslab.errors import EnvironmentSetupError
from fineslab.sglang_plugin import CONTACTS, HOOK_TARGETS, Contact, Kind, check_contacts
from fineslab.sglang_plugin.config import TESTED_SGLANG_VERSION
from fineslab.sglang_plugin.contact_check import problems_of
from fineslab.sglang_plugin.hooks import PluginSession
from fineslab.sglang_plugin.refusals import PARALLEL_SIZES, REFUSALS

PLUGIN_DIR = Path(plugin.__file__).parent
TABLE_MODULES = {"contact.py", "contact_check.py"}  # the table itself, not a user of it
ALLOCATOR = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"

#: Variable names under which plugin code holds SGLang objects, and their classes.
TYPED_NAMES = {
    "configurator": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator",
    "model_config": "sglang.srt.configs.model_config.ModelConfig",
    "checker": "sglang.srt.managers.scheduler_components.invariant_checker."
               "SchedulerInvariantChecker",
    "ps": "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats",
    "scheduler": "sglang.srt.managers.scheduler.Scheduler",
    "batch": "sglang.srt.managers.schedule_batch.ScheduleBatch",
    "running_batch": "sglang.srt.managers.schedule_batch.ScheduleBatch",
    "layer": "sglang.srt.layers.radix_attention.RadixAttention",
    "server_args": "sglang.srt.server_args.ServerArgs",
    "HookRegistry": "sglang.srt.plugins.hook_registry.HookRegistry",
    "HookType": "sglang.srt.plugins.hook_registry.HookType",
    "forward_batch": "sglang.srt.model_executor.forward_batch_info.ForwardBatch",
    "req": "sglang.srt.managers.schedule_batch.Req",
    "chunked": "sglang.srt.managers.schedule_batch.Req",
    "other": "sglang.srt.managers.schedule_batch.Req",
    "tree_cache": "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache",
}
#: SGLang objects reached through one more step: (variable, attribute or subscript) -> class.
CHAINED_NAMES = {
    ("configurator", "layer_info"):
        "sglang.srt.model_executor.model_runner_components.layer_setup.ModelLayerInfo",
    ("kwargs", "sizes"): "sglang.srt.mem_cache.kv_cache_configurator._PoolSizes",
    # The attention backend's pools (kv4_backend.py, a TorchNativeAttnBackend).
    ("self", "req_to_token_pool"): "sglang.srt.mem_cache.memory_pool.ReqToTokenPool",
    ("self", "token_to_kv_pool"): "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
}

PATHS = {c.path for c in CONTACTS}


def _covered(path: str) -> bool:
    return path in PATHS or any(p.startswith(path + ".") for p in PATHS)


# -- the installed SGLang ----------------------------------------------------------------------

def test_the_installed_sglang_passes_the_whole_table() -> None:
    start = time.monotonic()
    broken = {c.path: problems for c in CONTACTS if (problems := problems_of(c))}
    elapsed = time.monotonic() - start
    assert not broken, f"SGLang {sglang.__version__} breaks these contacts: {broken}"
    check_contacts()
    assert elapsed < 5, f"the start-up check must stay cheap; took {elapsed:.2f} s"


def test_rows_are_unique_and_every_hook_has_a_session_method() -> None:
    assert len(PATHS) == len(CONTACTS), "one row per SGLang name"
    assert [c.hook for c in HOOK_TARGETS] == [c.hook for c in CONTACTS if c.hook], \
        "HOOK_TARGETS are the table's hooked rows (one concept, one place)"
    for target in HOOK_TARGETS:
        assert callable(getattr(PluginSession, str(target.hook), None)), \
            f"PluginSession lacks {target.hook} for {target.path}"


# -- negative controls: a renamed or reshaped SGLang fails, naming the contact ----------------

def _failure(contacts: list[Contact] | None = None) -> str:
    with pytest.raises(EnvironmentSetupError) as err:
        check_contacts(CONTACTS if contacts is None else contacts)
    message = str(err.value)
    assert sglang.__version__ in message and TESTED_SGLANG_VERSION in message, \
        "the error names the installed and the tested SGLang"
    return message


def test_a_renamed_private_method_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(PagedTokenToKVPoolAllocator, "_release_page_ids")
    message = _failure()
    assert f"{ALLOCATOR}._release_page_ids (method): missing" in message, message
    assert "private free list" in message, "the error says why the plugin needs it"


def test_a_changed_signature_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    def alloc_decode(self: object, seq_lens: object, last_loc: object) -> None: ...

    monkeypatch.setattr(PagedTokenToKVPoolAllocator, "alloc_decode", alloc_decode)
    message = _failure()
    assert f"{ALLOCATOR}.alloc_decode (method): no parameter(s) ['seq_lens_cpu']" in message


def test_a_free_path_that_bypasses_the_override_stops_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang keeps `_release_page_ids` but `free` stops calling it: freed pages would go to
    SGLang's private list while the plugin's override never runs."""
    def free(self: PagedTokenToKVPoolAllocator, free_index: object) -> None:
        self.free_pages = free_index

    monkeypatch.setattr(PagedTokenToKVPoolAllocator, "free", free)
    message = _failure()
    assert "_release_page_ids (method): free no longer mentions self._release_page_ids" \
        in message, message


class _Pool:
    """Stands for an SGLang class that sets `k_buffer` in its constructor."""

    def __init__(self) -> None:
        self.k_buffer: list[object] = []


class _RenamedPool:
    """The same class after a rename of the instance attribute."""

    def __init__(self) -> None:
        self.kv_buffers: list[object] = []


@dataclasses.dataclass
class _Stats:
    full_available_size: int


@dataclasses.dataclass
class _RenamedStats:
    available_tokens: int


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """`sglang.fineslab_fake`, importable by dotted path for the duration of a test."""
    module = types.ModuleType("sglang.fineslab_fake")
    for cls in (_Pool, _RenamedPool, _Stats, _RenamedStats):
        monkeypatch.setattr(cls, "__module__", module.__name__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    yield module


def test_an_instance_attribute_is_found_in_the_constructor_source(
        fake_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    row = Contact("sglang.fineslab_fake.Pool.k_buffer", Kind.ATTRIBUTE, "test",
                  in_source_of=("__init__",))
    monkeypatch.setattr(fake_module, "Pool", _Pool, raising=False)
    check_contacts([row])
    monkeypatch.setattr(fake_module, "Pool", _RenamedPool)
    message = _failure([row])
    assert "sglang.fineslab_fake.Pool.k_buffer (attribute): __init__ no longer mentions " \
           "self.k_buffer" in message, message


def test_a_declared_field_is_found_on_the_class(fake_module: types.ModuleType,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    row = Contact("sglang.fineslab_fake.Stats.full_available_size", Kind.ATTRIBUTE, "test")
    monkeypatch.setattr(fake_module, "Stats", _Stats, raising=False)
    check_contacts([row])
    monkeypatch.setattr(fake_module, "Stats", _RenamedStats)
    assert "full_available_size (attribute): not declared on _RenamedStats" in _failure([row])


def test_a_missing_module_class_or_function_stops_start_up() -> None:
    rows = [Contact("sglang.srt.no_such_module", Kind.MODULE, "test"),
            Contact("sglang.srt.utils.NoSuchClass", Kind.CLASS, "test"),
            Contact("sglang.srt.utils.get_num_new_pages", Kind.FUNCTION, "test", ("renamed",))]
    message = _failure(rows)
    for row in rows:
        assert row.path in message, f"the error names {row.path}"
    check_contacts([Contact("sglang.srt.utils", Kind.MODULE, "test")])


# -- completeness: every SGLang name in the plugin's source has a row ------------------------

def _is_docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    return isinstance(parent, ast.Expr)


def _sglang_base(cls: type) -> type | None:
    return next((c for c in cls.__mro__ if c.__module__.startswith("sglang")), None)


def _sglang_mentions(base: type) -> set[str]:
    """Names SGLang's classes in `base`'s MRO define or use as `self.X`."""
    names: set[str] = set()
    for cls in base.__mro__:
        if not cls.__module__.startswith("sglang"):
            continue
        names |= set(vars(cls))
        try:
            tree = ast.parse(inspect.getsource(cls))
        except (OSError, TypeError, IndentationError):
            continue
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return names


def _class_contacts(module_name: str, node: ast.ClassDef) -> set[str]:
    cls = getattr(sys.modules[module_name], node.name)
    base = _sglang_base(cls)
    if base is None:
        return set()
    base_path = f"{base.__module__}.{base.__qualname__}"
    sglang_names = _sglang_mentions(base)
    used = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Attribute):
            continue
        on_self = isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")
        on_super = isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name) \
            and sub.value.func.id == "super"
        if on_self or on_super:
            used.add(sub.attr)
    dunder = {n for n in used if n.startswith("__") and n != "__init__"}
    return {f"{base_path}.{n}" for n in used - dunder if n in sglang_names}


def _typed_contacts(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        target, attr = None, None
        if isinstance(node, ast.Attribute):
            target, attr = node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant):
            target, attr = node.args[0], str(node.args[1].value)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "dataclasses.replace" \
                and node.args and isinstance(node.args[0], ast.Name) and \
                node.args[0].id in TYPED_NAMES:
            found |= {f"{TYPED_NAMES[node.args[0].id]}.{k.arg}" for k in node.keywords}
        if target is None or attr is None:
            continue
        if isinstance(target, ast.Name) and target.id in TYPED_NAMES:
            found.add(f"{TYPED_NAMES[target.id]}.{attr}")
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            key = (target.value.id, target.attr)
            if key in CHAINED_NAMES:
                found.add(f"{CHAINED_NAMES[key]}.{attr}")
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and \
                isinstance(target.slice, ast.Constant):
            key = (target.value.id, str(target.slice.value))
            if key in CHAINED_NAMES:
                found.add(f"{CHAINED_NAMES[key]}.{attr}")
    return found


def _module_contacts(path: Path) -> set[str]:
    """Every SGLang name `path` touches, by the four rules of the module docstring."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    module_name = f"fineslab.sglang_plugin.{path.stem}"
    __import__(module_name)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("sglang.") and not _is_docstring(node, parents):
            found.add(node.value)
        elif isinstance(node, ast.ClassDef):
            found |= _class_contacts(module_name, node)
    return found | _typed_contacts(tree)


def test_every_sglang_name_in_the_plugin_source_has_a_row() -> None:
    found: dict[str, set[str]] = {}
    for path in sorted(PLUGIN_DIR.glob("*.py")):
        if path.name not in TABLE_MODULES:
            found[path.name] = _module_contacts(path)
    missing = {name: sorted(p for p in paths if not _covered(p))
               for name, paths in found.items()}
    missing = {name: paths for name, paths in missing.items() if paths}
    assert not missing, (
        "SGLang names the plugin touches without a row in contact.CONTACTS (add a row, with "
        f"why the plugin needs it): {missing}")
    every = set().union(*found.values())
    for must in ("_release_page_ids", "free_pages", "staged_pages", "_create_buffers",
                 "current_offset", "batch_is_full", "full_available_size", "num_effective_layers",
                 "_patched", "req_to_token", "seq_lens", "tp_q_head_num"):
        assert any(p.endswith("." + must) for p in every), f"the scan must see {must}"
    # settings_of reads the refused settings by name from a list: rows come from that list.
    for name in [r.setting for r in REFUSALS] + [name for name, _ in PARALLEL_SIZES]:
        assert f"{TYPED_NAMES['server_args']}.{name}" in PATHS, f"ServerArgs.{name} needs a row"


def test_the_scan_catches_an_unlisted_name() -> None:
    """The scan itself is tested: plugin code touching an SGLang name outside the table."""
    probe = (PLUGIN_DIR / "hooks.py").read_text() + (
        "\n\ndef _probe(scheduler, configurator):\n"
        "    return scheduler.no_such_private_name, configurator.layer_info.renamed_layers\n")
    found = _typed_contacts(ast.parse(probe))
    unlisted = sorted(p for p in found if not _covered(p))
    assert unlisted == sorted([f"{CHAINED_NAMES[('configurator', 'layer_info')]}.renamed_layers",
                               f"{TYPED_NAMES['scheduler']}.no_such_private_name"]), unlisted

"""The start-up check of the contact table: does the installed SGLang still have every name?

What each kind is checked by (no SGLang object is built, nothing is called):
    MODULE     it imports
    CLASS      it resolves to a class
    FUNCTION   it resolves to a callable whose signature has every listed parameter
    METHOD     the same, on the owner class; plus `in_source_of` (below)
    ATTRIBUTE  declared on the owner class (class attribute, method, property, dataclass or
               msgspec field, annotation in its MRO); or, when the row lists `in_source_of`,
               mentioned as `self.<name>` in the source of each listed method, looked up in every
               SGLang class of the owner's MRO that defines it (instance attributes exist only
               on instances: where SGLang sets them is the evidence)

Any failure raises EnvironmentSetupError naming each contact that broke, why the plugin needs
it, and the installed SGLang version against the tested one: the plugin refuses to start rather
than run half-hooked. Cost: about 100 signature and source look-ups, once per process, on modules
the scheduler imports anyway (measured in docs/plugin.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from collections.abc import Sequence

from fineslab.errors import EnvironmentSetupError
from fineslab.sglang_plugin.config import TESTED_SGLANG_VERSION
from fineslab.sglang_plugin.contact import CALLABLE_KINDS, CONTACTS, Contact, Kind


def sglang_version() -> str:
    """The installed SGLang's version string."""
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def _resolve(path: str) -> object:
    return pkgutil.resolve_name(path)


def _declared(owner: type, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    if name in getattr(owner, "__struct_fields__", ()):
        return True
    return any(name in vars(cls).get("__annotations__", {}) for cls in owner.__mro__)


def _sources_of(owner: type, method: str) -> list[str]:
    """The source of `method` in every SGLang class of `owner`'s MRO that defines it."""
    sources = []
    for cls in owner.__mro__:
        if not cls.__module__.startswith("sglang") or method not in vars(cls):
            continue
        member = inspect.unwrap(vars(cls)[method])
        try:
            sources.append(inspect.getsource(member))
        except (OSError, TypeError):
            continue
    return sources


def _source_problems(owner: type, contact: Contact) -> list[str]:
    mention = re.compile(rf"\bself\.{re.escape(contact.name)}\b")
    problems = []
    for method in contact.in_source_of:
        sources = _sources_of(owner, method)
        if not sources:
            problems.append(f"no method {method} to look in")
        elif not any(mention.search(s) for s in sources):
            problems.append(f"{method} no longer mentions self.{contact.name}")
    return problems


def _parameter_problems(function: object, contact: Contact) -> list[str]:
    if not callable(function):
        return ["not callable"]
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return ["no inspectable signature"] if contact.parameters else []
    absent = [p for p in contact.parameters if p not in params]
    return [f"no parameter(s) {absent}"] if absent else []


def problems_of(contact: Contact) -> list[str]:
    """What no longer holds of `contact` in the installed SGLang (empty when it holds)."""
    try:
        if contact.kind is Kind.MODULE:
            importlib.import_module(contact.path)
            return []
        if contact.kind is Kind.CLASS:
            return [] if isinstance(_resolve(contact.path), type) else ["not a class"]
        if contact.kind is Kind.FUNCTION:
            return _parameter_problems(_resolve(contact.path), contact)
        owner = _resolve(contact.owner)
    except (ImportError, AttributeError, ValueError) as exc:
        return [f"missing ({type(exc).__name__}: {exc})"]
    if not isinstance(owner, type):
        return [f"{contact.owner} is not a class"]
    problems = []
    if contact.kind in CALLABLE_KINDS:
        if not hasattr(owner, contact.name):
            return ["missing"]
        problems += _parameter_problems(getattr(owner, contact.name), contact)
    elif not contact.in_source_of and not _declared(owner, contact.name):
        problems.append(f"not declared on {owner.__name__}")
    return problems + _source_problems(owner, contact)


def check_contacts(contacts: Sequence[Contact] = CONTACTS) -> None:
    """Raise EnvironmentSetupError naming every contact the installed SGLang breaks."""
    broken = []
    for contact in contacts:
        for problem in problems_of(contact):
            broken.append(f"{contact.path} ({contact.kind.value}): {problem} [{contact.why}]")
    if broken:
        raise EnvironmentSetupError(
            f"fineslab's SGLang plugin relies on SGLang names that SGLang {sglang_version()} "
            f"does not have as SGLang {TESTED_SGLANG_VERSION} (tested) did; refusing to start "
            "rather than fall back to SGLang's own KV pool:\n  " + "\n  ".join(broken))

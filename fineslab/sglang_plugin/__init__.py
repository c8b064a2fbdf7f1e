"""fineslab's SGLang plugin: keep a runtime's KV cache in the shared slab arena.

The only fineslab package that imports SGLang at module level (its pool and allocator subclass
SGLang's). Everything else talks to it through the environment and the slab table.

Public API
    register()                    entry point, group `sglang.srt.plugins` (pyproject.toml);
                                  joins the arena named by FINESLAB_ARENA / FINESLAB_RUNTIME_ID,
                                  does nothing when they are unset
    install(join) -> session      the same for a custom SGLang build: call it in the scheduler
                                  process before SGLang builds its KV pool
    ArenaJoin(arena_name, runtime_id)   the join request; `.environ()` gives the variables,
                                  `ArenaJoin.from_env()` reads them
    CONTACTS, HOOK_TARGETS        every SGLang name the plugin relies on (`contact.py`), and the
                                  methods it wraps with AROUND hooks
    check_contacts()              raise EnvironmentSetupError naming each contact the installed
                                  SGLang breaks, with its version and the tested one
    SlabKVPool, SlabAllocator     the pool and allocator SGLang runs with (see their modules)
    refuse_unsupported(settings)  the start-up refusal of features the arena layout cannot serve

Memory accounting for the router and the launcher is read from the slab table itself
(`fineslab.slabs`), not from the runtime: see `accounting.py`.
"""

from __future__ import annotations

from fineslab.sglang_plugin.config import TESTED_SGLANG_VERSION, ArenaJoin
from fineslab.sglang_plugin.contact import CONTACTS, HOOK_TARGETS, Contact, Kind
from fineslab.sglang_plugin.contact_check import check_contacts
from fineslab.sglang_plugin.install import install, register
from fineslab.sglang_plugin.refusals import refuse_unsupported

__all__ = [
    "CONTACTS",
    "HOOK_TARGETS",
    "TESTED_SGLANG_VERSION",
    "ArenaJoin",
    "Contact",
    "Kind",
    "check_contacts",
    "install",
    "refuse_unsupported",
    "register",
]

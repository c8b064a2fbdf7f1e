"""SGLang features the slab pool cannot serve, refused at start-up with the reason.

The slab pool hands SGLang per-layer K/V *views* into a shared arena (row stride = the whole
token, all layers), and the set of slots a runtime owns changes while it runs. Features written
for one private, contiguous buffer per layer, or for a fixed pool size, would read or move the
wrong bytes; rather than let them corrupt a neighbour's KV, the plugin stops the runtime before it
serves anything. Each entry says what the feature assumes; lifting one means implementing that
path for the layout (see docs/plugin.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fineslab.errors import ConfigError


@dataclass(frozen=True)
class Refusal:
    """A server setting the plugin cannot serve: its name, the flag, and why."""

    setting: str
    flag: str
    reason: str


REFUSALS: tuple[Refusal, ...] = (
    Refusal("speculative_algorithm", "--speculative-algorithm",
            "speculative decoding copies KV between contiguous per-layer buffers"),
    Refusal("disaggregation_mode", "--disaggregation-mode",
            "PD disaggregation registers contiguous per-layer buffers for transfer"),
    Refusal("enable_hierarchical_cache", "--enable-hierarchical-cache",
            "HiCache copies contiguous per-layer buffers to host memory"),
    Refusal("enable_lmcache", "--enable-lmcache",
            "LMCache copies contiguous per-layer buffers"),
    Refusal("enable_hisparse", "--enable-hisparse",
            "HiSparse backs KV with host memory through its own allocator"),
    Refusal("enable_unified_memory", "--enable-unified-memory",
            "the unified pool carves KV from its own byte buffer"),
    Refusal("enable_page_major_kv_layout", "--enable-page-major-kv-layout",
            "the page-major layout replaces the per-token layout the arena uses"),
    Refusal("enable_kv_cache_sharding", "--enable-kv-cache-sharding",
            "KV sharding widens slot ids beyond the arena's"),
    Refusal("enable_memory_saver", "--enable-memory-saver",
            "the memory saver would release the shared arena under the neighbours"),
    Refusal("enable_dp_attention", "--enable-dp-attention",
            "DP attention ranks would allocate from one arena without agreeing"),
)

#: Values that mean "off" for a setting (SGLang uses None, False, "null" or 1 for these).
_OFF_VALUES: dict[str, tuple[object, ...]] = {
    "disaggregation_mode": (None, "null", ""),
}
PARALLEL_SIZES = (("tp_size", "--tp-size"), ("pp_size", "--pp-size"), ("dp_size", "--dp-size"))


def _is_on(setting: str, value: object) -> bool:
    off = _OFF_VALUES.get(setting, (None, False, 0, ""))
    return value not in off


def unsupported_settings(settings: Mapping[str, object]) -> list[str]:
    """One line per setting in `settings` that the slab pool cannot serve (empty: all fine).

    `settings` maps ServerArgs field names to values; absent names count as off.
    """
    problems = [
        f"{r.flag}={settings[r.setting]!r}: {r.reason}"
        for r in REFUSALS
        if r.setting in settings and _is_on(r.setting, settings[r.setting])
    ]
    for name, flag in PARALLEL_SIZES:
        size = settings.get(name)
        if isinstance(size, int) and size > 1:
            problems.append(
                f"{flag}={size}: each rank would draw different blocks from the shared arena; "
                "the plugin serves one rank per runtime")
    return problems


def refuse_unsupported(settings: Mapping[str, object]) -> None:
    """Raise ConfigError naming every unsupported setting, or return if there is none."""
    problems = unsupported_settings(settings)
    if problems:
        raise ConfigError(
            "fineslab slab KV pool: unsupported SGLang settings for a runtime that joins an "
            "arena:\n  " + "\n  ".join(problems)
            + "\nRemove them, or start this runtime without FINESLAB_ARENA.")


def settings_of(server_args: object) -> dict[str, object]:
    """The settings `refuse_unsupported` looks at, read from an SGLang ServerArgs.

    Read directly, never `if hasattr`: a renamed setting must not pass as "off" (start-up
    checks each name first, `contact.py`)."""
    names = [r.setting for r in REFUSALS] + [name for name, _ in PARALLEL_SIZES]
    return {name: getattr(server_args, name) for name in names}

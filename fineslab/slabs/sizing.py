"""Slab sizing: one slab size per device that is a multiple of every co-located block stride.

Why not the LCM of the raw block sizes: raw token sizes carry odd factors (a 36,864 B token is
9 x 2^12, an INT4 token 5 x 2^11 ...), so the LCM of four models' blocks easily reaches
gigabytes, and a slab that large strands up to one slab of memory per runtime. Instead we fix a
small candidate slab size S and *fit* each model to it: pick the page size (tokens_per_block)
from the allowed ones and pad the token stride up to the smallest stride that divides S evenly.

Invariants of a plan
    slab_bytes % fmt.block_stride_bytes == 0              for every format
    fmt.token_stride_bytes % alignment_bytes == 0
    fmt.padding_waste <= max_padding_waste                when `plan.within_bound`

Search (cost: microseconds to a few ms): candidates S are the 7-smooth numbers (2^a 3^b 5^c 7^d,
dense in divisors) in [min_slab_bytes, max_slab_bytes], smallest first. For a page size p the
stride is alignment * u with u a divisor of S / (p * alignment) and u >= ceil(token_bytes /
alignment); the smallest such u is the least padding. The first S whose worst padding waste is
within the bound wins; if none is, the S with the smallest worst waste (the smaller on ties).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fineslab.errors import ConfigError
from fineslab.slabs.formats import DEFAULT_ALIGNMENT_BYTES, BlockFormat, KVShape

_SMOOTH_PRIMES = (2, 3, 5, 7)
DEFAULT_PAGE_SIZES = (16, 32, 64)
MIB = 1 << 20


@dataclass(frozen=True)
class SlabPlan:
    """The slab size of one device and the block format of each co-located model."""

    slab_bytes: int
    formats: tuple[BlockFormat, ...]
    max_padding_waste: float

    @property
    def worst_padding_waste(self) -> float:
        return max(f.padding_waste for f in self.formats)

    @property
    def within_bound(self) -> bool:
        return self.worst_padding_waste <= self.max_padding_waste

    def format_of(self, name: str) -> BlockFormat:
        for fmt in self.formats:
            if fmt.name == name:
                return fmt
        raise ConfigError(f"no model named {name!r} in this slab plan")

    @property
    def max_blocks_per_slab(self) -> int:
        return max(fmt.blocks_per_slab(self.slab_bytes) for fmt in self.formats)


def smooth_numbers(low: int, high: int) -> list[int]:
    """All 2^a 3^b 5^c 7^d in [low, high], ascending."""
    found = [1]
    for prime in _SMOOTH_PRIMES:
        grown = []
        for base in found:
            value = base
            while value <= high:
                grown.append(value)
                value *= prime
        found = grown
    return sorted(v for v in found if v >= low)


def _divisors(value: int) -> list[int]:
    """Divisors of a 7-smooth number, ascending."""
    divisors = [1]
    for prime in _SMOOTH_PRIMES:
        power = 0
        while value % prime == 0:
            value //= prime
            power += 1
        divisors = [d * prime**k for d in divisors for k in range(power + 1)]
    if value != 1:
        raise ConfigError("internal: slab candidate is not 7-smooth")
    return sorted(divisors)


def fit_format(shape: KVShape, slab_bytes: int, page_sizes: Sequence[int],
               alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> BlockFormat | None:
    """The least-padded format of `shape` whose block stride divides `slab_bytes`, if any."""
    best: BlockFormat | None = None
    for fmt in page_formats(shape, slab_bytes, page_sizes, alignment_bytes):
        if best is None or fmt.token_stride_bytes < best.token_stride_bytes:
            best = fmt
    return best


def page_formats(shape: KVShape, slab_bytes: int, page_sizes: Sequence[int],
                 alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> list[BlockFormat]:
    """For each page size that fits `slab_bytes`, the least-padded format of `shape`."""
    formats = []
    min_units = math.ceil(shape.token_bytes / alignment_bytes)
    for page in page_sizes:
        unit = page * alignment_bytes
        if slab_bytes % unit:
            continue
        fitting = [u for u in _divisors(slab_bytes // unit) if u >= min_units]
        if fitting:
            formats.append(BlockFormat(shape, page, fitting[0] * alignment_bytes))
    return formats


def plan_slabs(shapes: Sequence[KVShape], *, page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
               min_slab_bytes: int = MIB, max_slab_bytes: int = 256 * MIB,
               max_padding_waste: float = 0.02,
               alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> SlabPlan:
    """Pick the smallest slab size that keeps every model's padding waste within the bound.

    Raises ConfigError when no candidate slab in the range fits every model at all (a block
    larger than `max_slab_bytes`, or page sizes incompatible with the alignment).
    """
    if not shapes:
        raise ConfigError("plan_slabs needs at least one model")
    if len({s.name for s in shapes}) != len(shapes):
        raise ConfigError("model names in a slab plan must be unique")
    if not 0.0 <= max_padding_waste < 1.0:
        raise ConfigError(f"max_padding_waste={max_padding_waste} must be in [0, 1)")
    fallback: SlabPlan | None = None
    for slab_bytes in smooth_numbers(min_slab_bytes, max_slab_bytes):
        fitted = [fit_format(s, slab_bytes, page_sizes, alignment_bytes) for s in shapes]
        formats = tuple(f for f in fitted if f is not None)
        if len(formats) != len(shapes):
            continue
        plan = SlabPlan(slab_bytes, formats, max_padding_waste)
        if plan.within_bound:
            return plan
        if fallback is None or plan.worst_padding_waste < fallback.worst_padding_waste:
            fallback = plan
    if fallback is None:
        raise ConfigError(
            f"no slab size in [{min_slab_bytes}, {max_slab_bytes}] B fits every model "
            f"with page sizes {tuple(page_sizes)}; raise max_slab_bytes")
    return fallback

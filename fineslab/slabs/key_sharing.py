"""Slab plans whose models share block sizes, for key pools (`fineslab.slabs.pooled`).

Runtimes whose blocks have the same stride share their slabs' free blocks (a key pool); models
of different keys cannot. So a plan where several models' blocks come out the same size strands
less: the BF16 8B (128 KiB a token) at page 20, the FP8 8B (64 KiB) at page 40 and a TP=2 shard
of the 70B (160 KiB) at page 16 all have 2.5 MiB blocks and can draw on one pool.

Search: for each 7-smooth slab size S up to `max_slab_bytes`, each model's candidate formats are
its least-padded format per allowed page size (`page_formats`) within the padding bound; among
every combination, the plan minimizes the expected waste in bytes

    waste(S, formats) = stranded_slabs x distinct keys x S     (partly used slabs per pool)
                      + live_blocks x sum of block strides     (half-used last blocks of the
                                                                requests in flight)
                      + model_kv_bytes x sum of padding waste  (stride padding)

`stranded_slabs` and `live_blocks` (defaults below) set the trade between fewer keys and
smaller blocks. They were chosen on the fragmentation benchmark's azure run (docs/slabs.md):
tuned there, so the ShareGPT run is the check that they carry over. `model_kv_bytes` is a
model's expected share of the arena (the benchmark passes arena / models).

Cost: the product of the candidate counts per S (combinations beyond MAX_COMBINATIONS are cut
to each model's smallest strides); about 2 s for four models and pages 16-64, once per plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from fineslab.errors import ConfigError
from fineslab.slabs.formats import DEFAULT_ALIGNMENT_BYTES, BlockFormat, KVShape
from fineslab.slabs.sizing import MIB, SlabPlan, page_formats, smooth_numbers

DEFAULT_LIVE_BLOCKS = 16
DEFAULT_STRANDED_SLABS = 4
DEFAULT_MODEL_KV_BYTES = 1 << 30
MAX_COMBINATIONS = 20_000


@dataclass(frozen=True)
class WasteModel:
    """The weights of the search's objective (module docstring)."""

    stranded_slabs: float = DEFAULT_STRANDED_SLABS
    live_blocks: float = DEFAULT_LIVE_BLOCKS
    model_kv_bytes: float = DEFAULT_MODEL_KV_BYTES

    def waste_bytes(self, slab_bytes: int, formats: Sequence[BlockFormat]) -> float:
        keys = {f.block_stride_bytes for f in formats}
        return (self.stranded_slabs * len(keys) * slab_bytes
                + self.live_blocks * sum(f.block_stride_bytes for f in formats)
                + self.model_kv_bytes * sum(f.padding_waste for f in formats))


def plan_shared_slabs(shapes: Sequence[KVShape], *, page_sizes: Sequence[int],
                      min_slab_bytes: int = MIB, max_slab_bytes: int = 64 * MIB,
                      max_padding_waste: float = 0.02, waste: WasteModel | None = None,
                      alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> SlabPlan:
    """The plan of least expected waste whose every format is within the padding bound."""
    if not shapes:
        raise ConfigError("plan_shared_slabs needs at least one model")
    model = waste or WasteModel()
    best: tuple[float, int, SlabPlan] | None = None
    for slab_bytes in smooth_numbers(min_slab_bytes, max_slab_bytes):
        options = []
        for shape in shapes:
            fitting = [f for f in page_formats(shape, slab_bytes, page_sizes, alignment_bytes)
                       if f.padding_waste <= max_padding_waste]
            options.append(_cut(fitting, len(shapes)))
        if not all(options):
            continue
        for formats in itertools.product(*options):
            cost = model.waste_bytes(slab_bytes, formats)
            if best is None or (cost, slab_bytes) < best[:2]:
                best = (cost, slab_bytes, SlabPlan(slab_bytes, tuple(formats),
                                                    max_padding_waste))
    if best is None:
        raise ConfigError(
            f"no slab size in [{min_slab_bytes}, {max_slab_bytes}] B fits every model within "
            f"{max_padding_waste:.1%} padding with page sizes {tuple(page_sizes)}")
    return best[2]


def _cut(formats: list[BlockFormat], num_models: int) -> list[BlockFormat]:
    """Keep the combination count under MAX_COMBINATIONS: each model's smallest strides."""
    keep = max(1, int(MAX_COMBINATIONS ** (1 / num_models)))
    return sorted(formats, key=lambda f: f.block_stride_bytes)[:keep]

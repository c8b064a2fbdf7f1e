"""The allocation schemes the fragmentation benchmark replays, and the fixed-block plan.

Each scheme is an arena allocator behind `Scheme` (a handle per successful alloc, None when it
fails); `SchemeSet` holds what a run's schemes are planned from and builds any of them for an
arena size; `fineslab.bench.fragmentation` replays a workload into them and reports. What each
must honor (a real implementation under SGLang; never worse than that):

  slab         fineslab itself: SlabTable + one allocator per model, slab plan of
               plan_shared_slabs (padded strides, whole slabs only: the arena's tail beyond the
               last slab is lost); models of equal block stride share a key pool (PooledSlabs),
               a model alone on its key keeps its own slabs (RuntimeSlabs). Called as the plugin
               calls it: without the allocator's placement hint (`near_block`), which the plugin
               does not pass (SGLang's reservation draws a step's pages before it says which
               request gets which)
  slab_private the same mechanism without key pools, over the plan of plan_slabs (least
               padding per model): what fineslab measured before key pools
  static       one private pool per model, sized in proportion to that model's exact mean KV
               demand in this very run (an oracle; an operator without the trace does no better);
               no padding, the slab plan's page sizes (slab's: key pools)
  fixed_block  one shared pool of uniform B-byte blocks. SGLang indexes a model's layer buffer
               by flat slot (k_buffer[layer][slot], one stride), so block b must be page b of
               every model's view: B = page x stride, stride >= token bytes, 16-byte aligned. A
               model whose token does not divide B pads its stride; the block's remainder
               B - page x token_bytes is lost in every block (`fixed_block_tokens`). Pages are at
               least the slab plan's smallest. Two B are tried and the better is the key:
               `fixed_block_largest` B = smallest page x the largest token (the paper's "single
               fixed block size"), `fixed_block_lowpad` the smallest 7-smooth B whose worst
               remainder is within plan_slabs' padding bound
  first_fit    variable-size blocks (each model's unpadded block) placed first-fit in address
               order in one byte range, no slabs; each block at a multiple of its own size,
               since page p of a model's flat view starts at p x page x token bytes. Two page
               choices are tried, the better is the key `first_fit`: `first_fit_plan_pages` the
               slab plan's pages (where three models' blocks coincide, which spares first fit
               most of its holes), `first_fit_min_page` every model at the smallest page (least
               half-used last blocks). `first_fit_unaligned` (the plan's pages) drops the
               alignment: not servable by SGLang, shown for scale

static and fixed_block are `CountingScheme`s (uniform blocks per pool: only a count to keep);
the first-fit variants are `FirstFitScheme`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.slabs.client import RuntimeSlabs
from fineslab.slabs.formats import DEFAULT_ALIGNMENT_BYTES, BlockFormat, KVShape
from fineslab.slabs.key_sharing import WasteModel, plan_shared_slabs
from fineslab.slabs.pooled import PooledSlabs
from fineslab.slabs.sizing import SlabPlan, plan_slabs, smooth_numbers
from fineslab.slabs.table import SlabTable, TableDims


class Scheme(Protocol):
    """An arena allocator under test: a handle per successful alloc, None when it fails."""

    def alloc(self, model: int, num_blocks: int) -> object | None: ...

    def free(self, model: int, handles: list[object]) -> None: ...

    def close(self) -> None:
        """Release what the scheme holds (files, shared tables); it is not used again."""


class SlabScheme:
    """fineslab's mechanism itself: a SlabTable (table file only) and one allocator a model.

    key_pools: models whose block strides are equal share their key's slabs (`PooledSlabs`,
    what the launcher does); a model alone on its key, or every model when key_pools is off,
    keeps slabs of its own (`RuntimeSlabs`).
    """

    def __init__(self, arena_bytes: int, slab_bytes: int, formats: list[BlockFormat],
                 folder: Path, key_pools: bool = True) -> None:
        max_bps = max(f.blocks_per_slab(slab_bytes) for f in formats)
        dims = TableDims(arena_bytes // slab_bytes, slab_bytes, max_bps, max_runtimes=8)
        self.table = SlabTable.create(folder / f"fragmentation-{id(self)}.table", dims,
                                      backing=0)
        strides = [f.block_stride_bytes for f in formats]
        self.clients: list[RuntimeSlabs | PooledSlabs] = [
            # No block cache: the replay counts a model's first refused allocation, and a
            # neighbour's cache goes back only at that neighbour's next call (the squeeze),
            # where a fleet's runtime retries a scheduler step later. This measures placement;
            # a cache hides at most a slab's worth a runtime (pool_cache.py).
            PooledSlabs(self.table, f.name, f, cache_blocks=0)
            if key_pools and strides.count(stride) > 1
            else RuntimeSlabs(self.table, f.name, f)
            for f, stride in zip(formats, strides, strict=True)]

    def alloc(self, model: int, num_blocks: int) -> object | None:
        try:
            return self.clients[model].alloc_array(num_blocks)
        except ArenaExhausted:
            return None

    def free(self, model: int, handles: list[object]) -> None:
        if handles:
            self.clients[model].free(np.concatenate(handles))  # type: ignore[arg-type]

    def close(self) -> None:
        """Check every invariant, unregister the models and remove the table file."""
        for client in self.clients:
            client.check_integrity()
            client.close()
        self.table.close()
        self.table.path.unlink(missing_ok=True)


class CountingScheme:
    """Pools of uniform blocks (no fragmentation inside a pool): static or one shared pool."""

    def __init__(self, capacity_blocks: list[int], pool_of_model: list[int]) -> None:
        self.capacity, self.pool_of = capacity_blocks, pool_of_model
        self.used = [0] * len(capacity_blocks)

    def alloc(self, model: int, num_blocks: int) -> object | None:
        pool = self.pool_of[model]
        if self.used[pool] + num_blocks > self.capacity[pool]:
            return None
        self.used[pool] += num_blocks
        return num_blocks

    def free(self, model: int, handles: list[object]) -> None:
        self.used[self.pool_of[model]] -= sum(handles)  # type: ignore[arg-type]

    def close(self) -> None:
        """Nothing to release."""


class FirstFitScheme:
    """Variable-size blocks, first fit in address order over a sorted list of holes.

    aligned: a block of size s starts at a multiple of s (flat slot indexing, see the module
    docstring); the bytes skipped to reach it stay a hole.
    """

    def __init__(self, arena_bytes: int, block_bytes: list[int], aligned: bool) -> None:
        self.block_bytes, self.aligned = block_bytes, aligned
        self.starts = np.array([0], dtype=np.int64)
        self.sizes = np.array([arena_bytes], dtype=np.int64)

    def alloc(self, model: int, num_blocks: int) -> object | None:
        size = self.block_bytes[model]
        starts, sizes = self.starts, self.sizes
        first = -(-starts // size) * size if self.aligned else starts
        fit = np.maximum((starts + sizes - first) // size, 0)
        total = np.cumsum(fit)
        if total.size == 0 or total[-1] < num_blocks:
            return None
        last = int(np.searchsorted(total, num_blocks))
        take = fit[: last + 1].copy()
        take[last] -= total[last] - num_blocks
        used = np.flatnonzero(take)
        chunk_starts, chunk_sizes = first[used], take[used] * size
        hole_ends = starts[used] + sizes[used]
        left = (starts[used], chunk_starts - starts[used])
        right = (chunk_starts + chunk_sizes, hole_ends - chunk_starts - chunk_sizes)
        keep = np.ones(starts.size, dtype=bool)
        keep[used] = False
        new_starts = np.concatenate([starts[keep], left[0], right[0]])
        new_sizes = np.concatenate([sizes[keep], left[1], right[1]])
        order = np.argsort(new_starts[new_sizes > 0], kind="stable")
        self.starts, self.sizes = new_starts[new_sizes > 0][order], new_sizes[new_sizes > 0][order]
        return list(zip(chunk_starts.tolist(), chunk_sizes.tolist(), strict=True))

    def free(self, model: int, handles: list[object]) -> None:
        chunks = sorted(c for handle in handles for c in handle)  # type: ignore[attr-defined]
        if not chunks:
            return
        starts = np.concatenate([self.starts, [c[0] for c in chunks]])
        sizes = np.concatenate([self.sizes, [c[1] for c in chunks]])
        order = np.argsort(starts, kind="stable")
        starts, sizes = starts[order], sizes[order]
        # coalesce: a hole starts a new run unless it begins where the previous one ends
        ends = starts + sizes
        if (starts[1:] < ends[:-1]).any():
            raise RuntimeError("first-fit baseline: a freed chunk overlaps a hole (a defect)")
        new_run = np.ones(starts.size, dtype=bool)
        new_run[1:] = starts[1:] != ends[:-1]
        run_id = np.cumsum(new_run) - 1
        self.starts = starts[new_run]
        self.sizes = np.bincount(run_id, weights=sizes).astype(np.int64)

    def close(self) -> None:
        """Nothing to release."""


def fixed_block_tokens(shape: KVShape, block_bytes: int, min_page: int,
                       alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int | None:
    """Tokens a shared `block_bytes` block holds for `shape` when SGLang indexes it flat.

    Block b must be page b of the model's view (slot s at s x stride), so block_bytes = page x
    stride exactly, with stride >= token_bytes and stride % alignment == 0; the largest page
    comes from the smallest such stride. The rest, block_bytes - page x token_bytes, is lost in
    every block. None when no stride gives at least `min_page` tokens.
    """
    if block_bytes % alignment_bytes:
        return None
    units = block_bytes // alignment_bytes
    low, high = -(-shape.token_bytes // alignment_bytes), units // min_page
    if high < low:
        return None
    strides = np.arange(low, high + 1, dtype=np.int64)
    fitting = strides[units % strides == 0]
    return int(units // fitting[0]) if fitting.size else None


@dataclass(frozen=True)
class FixedBlockPlan:
    """One block size for every model, and the tokens each model puts in a block."""

    block_bytes: int
    tokens_per_block: tuple[int, ...]
    token_bytes: tuple[int, ...]

    @property
    def remainder_waste(self) -> tuple[float, ...]:
        """Per model, the fraction of each block that no token uses."""
        return tuple(1 - p * t / self.block_bytes
                     for p, t in zip(self.tokens_per_block, self.token_bytes, strict=True))

    @classmethod
    def fit(cls, shapes: tuple[KVShape, ...], block_bytes: int, min_page: int
            ) -> FixedBlockPlan | None:
        pages = [fixed_block_tokens(s, block_bytes, min_page) for s in shapes]
        if any(p is None for p in pages):
            return None
        return cls(block_bytes, tuple(p for p in pages if p is not None),
                   tuple(s.token_bytes for s in shapes))


def fixed_block_plans(shapes: tuple[KVShape, ...], min_page: int, max_waste: float
                      ) -> dict[str, FixedBlockPlan]:
    """`largest`: B = min_page x the largest token stride; `lowpad`: the smallest 7-smooth B
    above it whose worst remainder waste is within `max_waste` (searched up to 16x)."""
    align = DEFAULT_ALIGNMENT_BYTES
    largest_bytes = min_page * max(-(-s.token_bytes // align) * align for s in shapes)
    largest = FixedBlockPlan.fit(shapes, largest_bytes, min_page)
    if largest is None:
        raise ConfigError(f"internal: {largest_bytes} B does not fit every model")
    plans = {"largest": largest}
    for block_bytes in smooth_numbers(largest_bytes, 16 * largest_bytes):
        plan = FixedBlockPlan.fit(shapes, block_bytes, min_page)
        if plan is not None and max(plan.remainder_waste) <= max_waste:
            plans["lowpad"] = plan
            break
    return plans


@dataclass(frozen=True)
class SchemeSet:
    """What a run's schemes are planned from, fixed once per run; `build` makes any of them
    for an arena size (the critical-arena bisection builds each scheme many times, and the
    plans must not move under it).

    shared / private: the slab plans of `slab` (key pools) and `slab_private`; fixed: the
    fixed-block plans by variant; demand_share: each model's share of the mean KV demand
    (static's oracle split); min_page: the smallest allowed page.
    """

    shapes: tuple[KVShape, ...]
    shared: SlabPlan
    private: SlabPlan
    fixed: dict[str, FixedBlockPlan]
    demand_share: tuple[float, ...]
    min_page: int

    @classmethod
    def plan(cls, shapes: tuple[KVShape, ...], page_sizes: tuple[int, ...],
             demand_share: np.ndarray, model_kv_bytes: float) -> SchemeSet:
        """`model_kv_bytes`: a model's expected KV bytes, the key-sharing planner's padding
        weight (the benchmark passes the trace's peak live bytes over the number of models)."""
        shared = plan_shared_slabs(shapes, page_sizes=page_sizes,
                                   waste=WasteModel(model_kv_bytes=model_kv_bytes))
        private = plan_slabs(shapes, page_sizes=page_sizes)
        fixed = fixed_block_plans(shapes, min(page_sizes), shared.max_padding_waste)
        share = tuple(float(v) for v in demand_share / demand_share.sum())
        return cls(shapes, shared, private, fixed, share, min(page_sizes))

    @property
    def names(self) -> tuple[str, ...]:
        return ("slab", "slab_private", "static",
                *(f"fixed_block_{name}" for name in self.fixed),
                "first_fit_plan_pages", "first_fit_min_page", "first_fit_unaligned")

    def tokens_per_block(self, name: str) -> np.ndarray:
        if name == "slab_private":
            pages = [f.tokens_per_block for f in self.private.formats]
        elif name.startswith("fixed_block_"):
            pages = list(self.fixed[name.removeprefix("fixed_block_")].tokens_per_block)
        elif name == "first_fit_min_page":
            pages = [self.min_page] * len(self.shapes)
        else:  # slab, static, first_fit_plan_pages, first_fit_unaligned: the key-pool plan
            pages = [f.tokens_per_block for f in self.shared.formats]
        return np.array(pages, dtype=np.int64)

    def build(self, name: str, arena_bytes: int, folder: Path) -> Scheme:
        """Scheme `name` over `arena_bytes` (a slab table file goes in `folder`)."""
        num_models = len(self.shapes)
        unpadded = [int(t) * s.token_bytes
                    for t, s in zip(self.tokens_per_block(name), self.shapes, strict=True)]
        if name in ("slab", "slab_private"):
            plan = self.shared if name == "slab" else self.private
            return SlabScheme(arena_bytes, plan.slab_bytes, list(plan.formats), folder,
                              key_pools=name == "slab")
        if name == "static":
            caps = [int(arena_bytes * share // block)
                    for share, block in zip(self.demand_share, unpadded, strict=True)]
            return CountingScheme(caps, list(range(num_models)))
        if name.startswith("fixed_block_"):
            block_bytes = self.fixed[name.removeprefix("fixed_block_")].block_bytes
            return CountingScheme([arena_bytes // block_bytes], [0] * num_models)
        if name in ("first_fit_plan_pages", "first_fit_min_page", "first_fit_unaligned"):
            return FirstFitScheme(arena_bytes, unpadded, aligned=name != "first_fit_unaligned")
        raise ConfigError(f"unknown scheme {name!r}; known: {', '.join(self.names)}")

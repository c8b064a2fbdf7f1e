"""The KV slab arena: one pre-allocated byte tensor per device shared by every runtime on it,
cut into uniform slabs, each formatted to one model's KV block size (FineServe, section 5).

This package never imports SGLang; the SGLang plugin is built on the API below.

API for the launcher (owner of a device)
    plan = plan_slabs([KVShape(name, num_layers, num_kv_heads, head_dim, KVDtype.BF16, tp_size),
                       ...], page_sizes=(16, 32, 64), max_padding_waste=0.02)
        -> SlabPlan(slab_bytes, formats: tuple[BlockFormat, ...]); plan.format_of(name)
    spec = ArenaSpec.fit(fleet_id, device, budget_bytes, plan.slab_bytes, list(plan.formats))
    arena = SlabArena.create(spec)          # "cpu0" -> shm file; "cuda:0" -> CUDA IPC
    arena.close()                           # creator: also unlinks the shm files

API for a runtime (the SGLang plugin, in the scheduler process)
    arena = SlabArena.attach(fleet_id, device)
    kv = layer_views(arena.tensor(), fmt)   # fineslab.slabs.views (imports torch; the rest of
        # the package does not): list[LayerKV], one per layer:
        # BF16/FP16: k, v  [num_slots, kv_heads, head_dim]  bf16/fp16, row stride = token stride
        # FP8:       k, v  same shape, uint8 (view as float8_e4m3fn; scale per layer elsewhere)
        # INT4:      k, v  [num_slots, kv_heads, head_dim // 2] uint8 (two values a byte)
        #            k_params, v_params [num_slots, kv_heads, 2] fp16 (scale, zero) per token
    slabs = arena.client(runtime_id, fmt)   # or RuntimeSlabs.attach(fleet_id, device, id, fmt)
        # arena.client(runtime_id, fmt, pooled=True): a PooledSlabs in its key's pool, shared
        # with the other pooled runtimes of the same block stride (same methods below)
    slabs.alloc(num_blocks, near_block=None) -> list[int]   # engine block ids == page indices;
        # all or nothing; raises ArenaExhausted (transient). alloc_array(...) -> np.ndarray int64
        # (torch.from_numpy-ready). near_block: a block the same request holds (last_loc //
        # page_size) for decode/extend; placement then keeps a request's blocks together so
        # slabs empty and return (a small gain, docs/slabs.md; the SGLang plugin does not pass
        # it: its reservation draws a step's pages before SGLang says which request gets which)
    slabs.free(block_ids)                   # InvalidBlockError on double/foreign free, no change
    slabs.num_free_blocks() -> int          # free blocks in its own slabs (pooled: the pool's
        # and its block cache's: up to a slab of blocks it keeps, used for every neighbour)
    slabs.release_cache() -> int            # give that cache back (the plugin, at idle)
    slabs.available_blocks() -> int         # + what the free slabs would give it now
    slabs.num_blocks_total                  # size of the page index space (num_slots // tpb)
    slabs.stats() -> RuntimeStats; slabs.check_integrity(); slabs.close()
    Page p of the format covers token slots [p * fmt.tokens_per_block, (p + 1) * tpb), so a
    block id is SGLang's page id and `slot // page_size` recovers it.

API for observers (router, operator)
    table = SlabTable.open(ArenaPaths.of(fleet_id, device).table, writable=False)
    snapshot(table) -> TableSnapshot (slabs per key and state, bytes per owner, free bytes)
    table.reclaim_dead_owners() -> list[str]; check_integrity(table)
    python -m fineslab.slabs --fleet F --device cpu0   (or --table /dev/shm/...table)

Modules: formats (token and block sizes), sizing (slab size), views (per-layer tensors), shm
(files, process identity), table (shared table, lock, carve/release/reclaim), integrity
(invariants, snapshot), client (per-runtime fast path), pooled (key pools: runtimes of one
block stride sharing slabs), key_sharing (plans whose models share block sizes), arena
(backings), cuda_backing (IPC).
"""

from __future__ import annotations

from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.client import RuntimeSlabs, RuntimeStats
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape
from fineslab.slabs.integrity import TableSnapshot, check_integrity, snapshot
from fineslab.slabs.pooled import PooledSlabs
from fineslab.slabs.shm import ArenaPaths
from fineslab.slabs.sizing import SlabPlan, plan_slabs
from fineslab.slabs.table import SlabState, SlabTable

__all__ = [
    "ArenaPaths", "ArenaSpec", "BlockFormat", "KVDtype", "KVShape", "PooledSlabs", "RuntimeSlabs",
    "RuntimeStats", "SlabArena", "SlabPlan", "SlabState", "SlabTable", "TableSnapshot",
    "check_integrity", "plan_slabs", "snapshot",
]

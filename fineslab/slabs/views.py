"""Per-layer K/V views over the arena: what SGLang's attention reads and writes.

SGLang indexes a layer's buffer by flat token slot (`k_buffer[layer][loc]`) with one stride per
buffer, so every format uses a token-interleaved layout that is affine over the whole arena:

    arena (uint8):  | slot 0 | slot 1 | ... | slot s | ...       slot s starts at s * token_stride
    one slot:       | layer 0 | layer 1 | ... | layer L-1 | padding |
    one layer:      | K values | V values | K params | V params |  (params: INT4 only)
    K values:       [kv_heads, head_dim] elements; INT4: [kv_heads, head_dim // 2] bytes, the
                    low nibble holds the even element, the high nibble the odd one
    K params:       [kv_heads, 2] fp16 = (scale, zero) per head, for this token

Block b of a format holds slots [b * tokens_per_block, (b + 1) * tokens_per_block), and slabs
start at multiples of the block stride (sizing.py), so engine block id == global page index.

Invariants
    byte(slot s, layer l, part) = s * token_stride_bytes + l * layer_bytes + part_offset
    num_slots = arena_bytes // token_stride_bytes
    views of different (slot, layer, part) never overlap

Building the views costs nothing (`as_strided`, no copy); reading a layer costs one strided
gather on CPU and uncoalesced rows on GPU (see SGLANG-ON-CPU.md for what that costs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fineslab.errors import ConfigError
from fineslab.slabs.formats import BlockFormat, KVDtype

_STORAGE_DTYPE = {
    KVDtype.BF16: torch.bfloat16,
    KVDtype.FP16: torch.float16,
    KVDtype.FP32: torch.float32,
    KVDtype.FP8_E4M3: torch.uint8,  # SGLang stores fp8 KV as uint8 and views it as float8
    KVDtype.INT4: torch.uint8,
}


@dataclass(frozen=True)
class LayerKV:
    """One layer's K and V over every slot of the arena; params only for INT4."""

    k: torch.Tensor
    v: torch.Tensor
    k_params: torch.Tensor | None
    v_params: torch.Tensor | None


def num_slots(arena_bytes: int, fmt: BlockFormat) -> int:
    return arena_bytes // fmt.token_stride_bytes


def _strided(arena: torch.Tensor, dtype: torch.dtype, offset_bytes: int, stride_bytes: int,
             rows: int, heads: int, width: int) -> torch.Tensor:
    """A [rows, heads, width] view of `dtype` starting `offset_bytes` into `arena`."""
    elem = torch.empty((), dtype=dtype).element_size()
    typed = arena if elem == 1 else arena.view(dtype)
    return typed.as_strided(
        (rows, heads, width), (stride_bytes // elem, width, 1),
        typed.storage_offset() + offset_bytes // elem)


def layer_views(arena: torch.Tensor, fmt: BlockFormat) -> list[LayerKV]:
    """The per-layer K/V views of `fmt` over `arena` (a 1-D uint8 tensor, any device)."""
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise ConfigError("layer_views needs a 1-D uint8 arena tensor")
    if arena.numel() % 2 or arena.storage_offset() % 2:
        raise ConfigError("the arena must have an even size and offset for 16-bit views")
    shape = fmt.shape
    rows = num_slots(arena.numel(), fmt)
    heads, stride = shape.kv_heads_per_rank, fmt.token_stride_bytes
    dtype = _STORAGE_DTYPE[shape.kv_dtype]
    width = shape.head_dim // 2 if shape.kv_dtype is KVDtype.INT4 else shape.head_dim
    values, params = shape.layer_values_bytes, shape.layer_params_bytes
    views = []
    for layer in range(shape.num_layers):
        base = layer * shape.layer_bytes
        k = _strided(arena, dtype, base, stride, rows, heads, width)
        v = _strided(arena, dtype, base + values, stride, rows, heads, width)
        k_params = v_params = None
        if params:
            k_params = _strided(arena, torch.float16, base + 2 * values, stride, rows, heads, 2)
            v_params = _strided(arena, torch.float16, base + 2 * values + params, stride, rows,
                                heads, 2)
        views.append(LayerKV(k, v, k_params, v_params))
    return views

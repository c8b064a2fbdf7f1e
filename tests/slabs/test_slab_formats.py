"""Block formats, slab sizing and per-layer views: sizes, divisibility, isolation of views."""

from __future__ import annotations

import pytest
import torch

from fineslab.errors import ConfigError
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape
from fineslab.slabs.sizing import fit_format, plan_slabs, smooth_numbers
from fineslab.slabs.views import layer_views

LLAMA8B = KVShape("llama8b", 32, 8, 128, KVDtype.BF16)
FP8 = KVShape("llama8b-fp8", 32, 8, 128, KVDtype.FP8_E4M3)
INT4 = KVShape("qwen7b-int4", 28, 4, 128, KVDtype.INT4)
TP2 = KVShape("llama70b-tp2", 80, 8, 128, KVDtype.BF16, tp_size=2)
ODD = KVShape("odd", 36, 9, 96, KVDtype.FP16)


def test_token_bytes_follow_the_formula() -> None:
    assert LLAMA8B.token_bytes == 32 * 2 * 8 * 128 * 2, "bf16: layers x 2 x heads x dim x 2"
    assert FP8.token_bytes == 32 * 2 * 8 * 128, "fp8: one byte per value, scale outside"
    assert INT4.token_bytes == 28 * (2 * 4 * 64 + 2 * 4 * 4), "int4: packed + (scale, zero)"
    assert TP2.kv_heads_per_rank == 4, "TP=2 halves the KV heads of a rank"
    assert TP2.token_bytes == 80 * 2 * 4 * 128 * 2


def test_tp_larger_than_heads_replicates_one_head() -> None:
    shape = KVShape("mqa", 4, 2, 64, KVDtype.BF16, tp_size=8)
    assert shape.kv_heads_per_rank == 1


@pytest.mark.parametrize("kwargs", [
    {"num_layers": 0}, {"head_dim": -1}, {"num_kv_heads": 3, "tp_size": 2},
])
def test_bad_shapes_are_refused(kwargs: dict[str, int]) -> None:
    args = {"name": "x", "num_layers": 2, "num_kv_heads": 4, "head_dim": 64,
            "kv_dtype": KVDtype.BF16, **kwargs}
    with pytest.raises(ConfigError):
        KVShape(**args)  # type: ignore[arg-type]


def test_int4_refuses_odd_head_dim() -> None:
    with pytest.raises(ConfigError):
        KVShape("x", 2, 2, 65, KVDtype.INT4)


def test_stride_smaller_than_token_is_refused() -> None:
    with pytest.raises(ConfigError):
        BlockFormat(LLAMA8B, 16, LLAMA8B.token_bytes - 16)


def test_blocks_per_slab_refuses_a_block_that_does_not_fit() -> None:
    fmt = BlockFormat.unpadded(LLAMA8B, 16)
    with pytest.raises(ConfigError):
        fmt.blocks_per_slab(fmt.block_stride_bytes * 3 + 16)


def test_smooth_numbers_are_smooth_and_sorted() -> None:
    values = smooth_numbers(1000, 5000)
    assert values == sorted(values) and values[0] >= 1000 and values[-1] <= 5000
    for value in values:
        for prime in (2, 3, 5, 7):
            while value % prime == 0:
                value //= prime
        assert value == 1, "every candidate factors over 2, 3, 5, 7"


def test_plan_divides_the_slab_and_bounds_the_waste() -> None:
    plan = plan_slabs([LLAMA8B, FP8, INT4, TP2, ODD], max_padding_waste=0.02)
    assert plan.within_bound, "a 2% bound is reachable for these models"
    for fmt in plan.formats:
        assert plan.slab_bytes % fmt.block_stride_bytes == 0, f"{fmt.name} divides the slab"
        assert fmt.token_stride_bytes % 16 == 0, "strides stay 16-byte aligned"
        assert fmt.padding_waste <= 0.02
    assert plan.slab_bytes <= 256 << 20, "the slab stays far below the raw LCM"


def test_plan_prefers_the_smallest_slab() -> None:
    plan = plan_slabs([LLAMA8B], page_sizes=(16,), max_padding_waste=0.0)
    assert plan.slab_bytes == 16 * LLAMA8B.token_bytes * 1, "one power-of-two block suffices"
    assert plan.formats[0].padding_waste == 0.0


def test_fit_format_returns_none_when_nothing_fits() -> None:
    assert fit_format(LLAMA8B, 1 << 20, page_sizes=(16,)) is None, "block > slab"


def test_plan_refuses_duplicate_names() -> None:
    with pytest.raises(ConfigError):
        plan_slabs([LLAMA8B, LLAMA8B])


TINY = [
    KVShape("bf16", 3, 2, 8, KVDtype.BF16),
    KVShape("fp16", 2, 1, 8, KVDtype.FP16),
    KVShape("fp8", 3, 2, 8, KVDtype.FP8_E4M3),
    KVShape("int4", 3, 2, 8, KVDtype.INT4),
]


def _parts(fmt: BlockFormat, arena: torch.Tensor) -> list[tuple[str, int, torch.Tensor, int]]:
    """(name, layer, view, in-layer byte offset) for every part of every layer."""
    shape = fmt.shape
    parts = []
    for layer, kv in enumerate(layer_views(arena, fmt)):
        values = shape.layer_values_bytes
        parts += [("k", layer, kv.k, 0), ("v", layer, kv.v, values)]
        if kv.k_params is not None and kv.v_params is not None:
            parts += [("kp", layer, kv.k_params, 2 * values),
                      ("vp", layer, kv.v_params, 2 * values + shape.layer_params_bytes)]
    return parts


@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.name)
def test_writing_one_layer_slot_touches_only_its_bytes(shape: KVShape) -> None:
    fmt = BlockFormat(shape, 4, shape.token_bytes + 6 + shape.token_bytes % 2)
    arena = torch.zeros(fmt.token_stride_bytes * 12, dtype=torch.uint8)
    for name, layer, view, offset in _parts(fmt, arena):
        for slot in (0, 5, 11):
            arena.zero_()
            view[slot].view(torch.uint8).fill_(0xFF)
            start = slot * fmt.token_stride_bytes + layer * shape.layer_bytes + offset
            size = view[slot].numel() * view.element_size()
            touched = torch.nonzero(arena).flatten().tolist()
            assert touched == list(range(start, start + size)), (
                f"{shape.name} {name}[layer {layer}][slot {slot}] writes only its own bytes")


@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.name)
def test_views_cover_every_slot_of_the_arena(shape: KVShape) -> None:
    fmt = BlockFormat.unpadded(shape, 4)
    arena = torch.zeros(fmt.token_stride_bytes * 10 + 2, dtype=torch.uint8)
    kv = layer_views(arena, fmt)
    assert len(kv) == shape.num_layers
    assert kv[0].k.shape[0] == 10, "one row per whole slot; the tail is ignored"
    assert kv[0].k.shape[1] == shape.kv_heads_per_rank
    assert (kv[0].k_params is not None) == (shape.kv_dtype is KVDtype.INT4)


def test_layer_views_refuse_a_non_byte_arena() -> None:
    fmt = BlockFormat.unpadded(TINY[0], 4)
    with pytest.raises(ConfigError):
        layer_views(torch.zeros(1024, dtype=torch.float32), fmt)


def test_fp8_views_reinterpret_as_float8_like_sglang() -> None:
    fmt = BlockFormat.unpadded(TINY[2], 4)
    arena = torch.zeros(fmt.token_stride_bytes * 8, dtype=torch.uint8)
    k = layer_views(arena, fmt)[2].k
    as_fp8 = k.view(torch.float8_e4m3fn)
    as_fp8[3] = 1.0
    assert k[3].eq(0x38).all(), "1.0 in e4m3 is 0x38, written through the strided uint8 view"
    assert int(arena.count_nonzero()) == k[3].numel()

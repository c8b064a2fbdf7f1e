"""plan_shared_slabs: slab plans whose models share block sizes, for key pools."""

from __future__ import annotations

import pytest

from fineslab.bench import fragmentation as frag
from fineslab.errors import ConfigError
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape
from fineslab.slabs.key_sharing import WasteModel, plan_shared_slabs

MIB = 1 << 20


def test_the_benchmark_models_get_one_key_for_the_three_large_tokens() -> None:
    # 8B BF16 (128 KiB a token) x 20 = 8B FP8 (64 KiB) x 40 = 70B TP=2 (160 KiB) x 16 = 2.5 MiB;
    # the INT4 token (15,232 B) pads to 15,360 B (0.83 %) at page 16 in a 7.5 MiB slab.
    plan = plan_shared_slabs(frag.MODELS, page_sizes=range(16, 65),
                             waste=WasteModel(model_kv_bytes=2 << 30))
    assert plan.slab_bytes == 7.5 * MIB
    assert [f.tokens_per_block for f in plan.formats] == [20, 40, 16, 16]
    strides = [f.block_stride_bytes for f in plan.formats]
    assert strides[0] == strides[1] == strides[3] == 2.5 * MIB, "one key pool for three models"
    assert all(plan.slab_bytes % s == 0 for s in strides), "every block divides the slab"
    assert plan.within_bound and plan.worst_padding_waste == pytest.approx(1 - 15232 / 15360)


def test_the_waste_weights_trade_fewer_keys_against_smaller_blocks() -> None:
    # A 64 B token and a 32 B token: page 16 for both gives 1,024 B and 512 B blocks (two keys);
    # page 32 for the second shares the first's 1,024 B key at twice its block size.
    shapes = [KVShape("a", 1, 1, 16, KVDtype.BF16), KVShape("b", 1, 1, 8, KVDtype.BF16)]
    pages = (16, 32)
    stranding = plan_shared_slabs(shapes, page_sizes=pages, min_slab_bytes=1024,
                                  waste=WasteModel(stranded_slabs=100, live_blocks=1))
    blocks = plan_shared_slabs(shapes, page_sizes=pages, min_slab_bytes=1024,
                               waste=WasteModel(stranded_slabs=0.01, live_blocks=100))
    assert [f.block_stride_bytes for f in stranding.formats] == [1024, 1024]
    assert [f.block_stride_bytes for f in blocks.formats] == [1024, 512]
    cost = WasteModel(stranded_slabs=2, live_blocks=3, model_kv_bytes=0)
    fmts = [BlockFormat.unpadded(shapes[0], 16), BlockFormat.unpadded(shapes[1], 16)]
    assert cost.waste_bytes(2048, fmts) == 2 * 2 * 2048 + 3 * (1024 + 512)


def test_no_plan_within_the_padding_bound_is_a_clear_error() -> None:
    odd = KVShape("odd", 1, 1, 15, KVDtype.BF16)  # 60 B: pads to 64 B (6.25 %)
    with pytest.raises(ConfigError, match="padding"):
        plan_shared_slabs([odd], page_sizes=(16,), max_padding_waste=0.01,
                          max_slab_bytes=4 * MIB)

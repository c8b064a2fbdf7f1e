"""The KV4 and FP8 slab pools on their own: quantize on write, dequantize the asked slots.

SGLang's pool class is built over per-layer views of a plain arena tensor (no table, no server):
what a runtime's attention reads back must equal dequantize(quantize(written)) exactly, and stay
within the format's error bound of what was written: KV4 <= scale / 2 + 1e-2 per element; FP8
(e4m3, scale s) <= 2^-4 |x| + s * 2^-9.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fineslab.quant.kv4 import dequantize_kv4, quantize_kv4
from fineslab.slabs import BlockFormat, KVShape
from fineslab.slabs.formats import KVDtype
from fineslab.slabs.views import layer_views

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 64, 16


def _pool(kv_dtype: KVDtype, scales: tuple[float, ...] = ()):  # type: ignore[no-untyped-def]
    from fineslab.sglang_plugin.quant_pools import Fp8SlabKVPool, Kv4SlabKVPool

    fmt = BlockFormat.unpadded(KVShape("m", LAYERS, HEADS, HEAD_DIM, kv_dtype), PAGE)
    arena = torch.zeros(fmt.token_stride_bytes * 8 * PAGE, dtype=torch.uint8)
    views = layer_views(arena, fmt)
    cls = (Kv4SlabKVPool.over(views) if kv_dtype is KVDtype.INT4
           else Fp8SlabKVPool.with_scales(views, scales))
    return cls(size=6 * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
               head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)


def _kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(5, HEADS, HEAD_DIM, generator=gen) * 4).to(torch.bfloat16)


def test_kv4_pool_reads_back_what_it_wrote() -> None:
    pool = _pool(KVDtype.INT4)
    loc = torch.tensor([17, 3, 40, 41, 90])
    k, v = _kv(0), _kv(1)
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, k, v)
    got_k = pool.get_key_buffer(1)[loc]
    assert got_k.dtype == torch.bfloat16 and got_k.shape == (5, HEADS, HEAD_DIM)
    assert torch.equal(got_k, dequantize_kv4(*quantize_kv4(k), torch.bfloat16))
    _packed, params = quantize_kv4(v)
    err = (pool.get_value_buffer(1)[loc].float() - v.float()).abs()
    assert bool((err <= params[..., :1].float() / 2 + 1e-2 + v.float().abs() / 128).all())
    assert float(pool.get_key_buffer(0)[loc].abs().max()) == 0.0, "layer 0 must be untouched"


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_fp8_pool_applies_the_layer_scale(scale: float) -> None:
    pool = _pool(KVDtype.FP8_E4M3, scales=(1.0, scale))
    loc = torch.tensor([5, 6, 7, 8, 9])
    k = _kv(2)
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, k, k)
    got = pool.get_key_buffer(1)[loc].float()
    err = (got - k.float()).abs()
    assert bool((err <= k.float().abs() * 2**-4 + scale * 2**-9 + 1e-2).all())
    stored = pool.arena_views[1].k[loc].view(torch.float8_e4m3fn).float()
    assert torch.allclose(stored * scale, got, rtol=1e-2, atol=1e-3), "stored = x / scale"


def test_pool_refuses_a_format_of_another_model() -> None:
    from fineslab.errors import ConfigError
    from fineslab.sglang_plugin.quant_pools import Kv4SlabKVPool

    fmt = BlockFormat.unpadded(KVShape("m", LAYERS, HEADS, HEAD_DIM, KVDtype.INT4), PAGE)
    views = layer_views(torch.zeros(fmt.token_stride_bytes * 8 * PAGE, dtype=torch.uint8), fmt)
    with pytest.raises(ConfigError, match="wrong block format"):
        Kv4SlabKVPool.over(views)(size=6 * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                  head_num=HEADS, head_dim=128, layer_num=LAYERS, device="cpu",
                                  enable_memory_saver=False)

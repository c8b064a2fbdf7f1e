"""Quantized-KV slab pools: KV4 (QoQ) and scaled FP8, quantizing on write, dequantizing on read.

Glossary
    model dtype   what SGLang computes in and believes its KV is (bf16/fp16): SGLang's own
                  `--kv-cache-dtype` stays `auto`, the slab format carries the real storage type
    values view   [slots, kv_heads, width] uint8 over the arena (`fineslab.slabs.views`):
                  INT4 width = head_dim // 2 (two codes a byte), FP8 width = head_dim (e4m3 bits)
    params view   INT4 only: [slots, kv_heads, 2] fp16 (scale, zero) per token and head
    kv scale      FP8 only: one float per layer; stored = x / scale, read = stored * scale

Why not SGLang's FP8 KV: on CPU SGLang 0.5.23 refuses `--kv-cache-dtype fp8_e4m3` unless Intel
AMX kernels and the `intel_amx` backend are present (`KVCacheConfigurator.configure`), and its
torch_native backend never passes `k_scale` to `set_kv_buffer` nor applies it on read. On a GPU
the stock `SlabKVPool` with SGLang's FP8 KV and the triton backend is the FP8 path; these pools
are the CPU path (and KV4's only path in SGLang, which has no 4-bit KV).

Invariants (per layer l)
    write(loc, x) then read(loc) == dequantize(quantize(x))     for every written slot
    reads touch only the slots asked for (`reader[slots]`), never the whole arena
    the views' geometry equals the format's: rows >= size + page_size, heads == head_num

Reading works with SGLang's torch_native backend, which only indexes `k_cache[slots]`. The
triton/flashinfer backends need real tensors: a GPU KV4 runtime runs the plugin's `fineslab_kv4`
backend (`kv4_backend.py`), whose decode reads the `Kv4Reader`s' packed views with
`fineslab.quant.kv4_triton` (prefill stays torch_native's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

from fineslab.errors import ConfigError
from fineslab.quant.kv4 import Kv4Reader, write_kv4
from fineslab.sglang_plugin.pool import SlabKVPool
from fineslab.slabs.views import LayerKV

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Reader:
    """One layer's FP8 K or V as torch_native reads it: `reader[slots]` in `dtype`, scaled."""

    values: torch.Tensor
    scale: float
    dtype: torch.dtype

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        stored = self.values[slots].view(torch.float8_e4m3fn)
        return (stored.to(torch.float32) * self.scale).to(self.dtype)


class _QuantSlabKVPool(SlabKVPool):
    """Shared buffer set-up of the quantized pools; subclasses say the geometry and the codec."""

    values_width_divisor: ClassVar[int] = 1
    needs_params: ClassVar[bool] = False

    def _create_buffers(self) -> None:
        if self.post_capture_active:
            raise ConfigError("quantized slab KV: post-capture KV backing is not supported")
        views = self.arena_views
        self._check_quant_views(views, self.size + self.page_size)
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        self.k_buffer = [view.k for view in views]
        self.v_buffer = [view.v for view in views]
        self._kv_buffer_descs: list[Any] = []
        self._init_data_ptrs_and_strides()
        logger.info("%s: %d layers x %d slots over the arena", type(self).__name__,
                    self.layer_num, self.k_buffer[0].shape[0])

    def _check_quant_views(self, views: Sequence[LayerKV], num_rows: int) -> None:
        if len(views) != self.layer_num:
            raise ConfigError(f"{type(self).__name__}: the arena format has {len(views)} "
                              f"layers, the model {self.layer_num}")
        k0 = views[0].k
        width = self.head_dim // self.values_width_divisor
        if tuple(k0.shape[1:]) != (self.head_num, width) or k0.dtype != torch.uint8:
            raise ConfigError(
                f"{type(self).__name__}: arena views are {tuple(k0.shape[1:])} {k0.dtype}, the "
                f"model needs ({self.head_num}, {width}) uint8: wrong block format")
        if self.needs_params and views[0].k_params is None:
            raise ConfigError(f"{type(self).__name__}: the block format has no scale/zero")
        if k0.shape[0] < num_rows:
            raise ConfigError(f"{type(self).__name__}: the arena has {k0.shape[0]} slots, "
                              f"SGLang asks for {num_rows}")

    def _local(self, layer: Any, layer_id_override: int | None) -> int:
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        return int(layer_id) - self.start_layer

    def get_key_buffer(self, layer_id: int) -> Any:
        return self._get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> Any:
        return self._get_value_buffer(layer_id)


class Kv4SlabKVPool(_QuantSlabKVPool):
    """QoQ KV4 in the slab arena: 4-bit codes + per-token per-head (scale, zero) in the block."""

    values_width_divisor = 2
    needs_params = True

    def _get_key_buffer(self, layer_id: int) -> Kv4Reader:
        view = self.arena_views[layer_id - self.start_layer]
        assert view.k_params is not None
        return Kv4Reader(view.k, view.k_params, self.dtype)

    def _get_value_buffer(self, layer_id: int) -> Kv4Reader:
        view = self.arena_views[layer_id - self.start_layer]
        assert view.v_params is not None
        return Kv4Reader(view.v, view.v_params, self.dtype)

    def set_kv_buffer(self, layer: Any, loc_info: Any, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, k_scale: float | None = None,
                      v_scale: float | None = None, layer_id_override: int | None = None,
                      dcp_kv_mask: torch.Tensor | None = None) -> None:
        """Quantize the new tokens' K and V into their slots (SGLang's scales do not apply)."""
        if dcp_kv_mask is not None:
            raise ConfigError("Kv4SlabKVPool: decode context parallelism is not supported")
        loc, _, _ = unwrap_write_loc(loc_info)
        view = self.arena_views[self._local(layer, layer_id_override)]
        assert view.k_params is not None and view.v_params is not None
        heads = (-1, self.head_num, self.head_dim)
        write_kv4(view.k, view.k_params, loc, cache_k.reshape(heads))
        write_kv4(view.v, view.v_params, loc, cache_v.reshape(heads))


class Fp8SlabKVPool(_QuantSlabKVPool):
    """FP8 e4m3 KV in the slab arena with one scale per layer (`kv_scales`, from a scales file
    or 1.0 with a warning), applied on write and on read."""

    kv_scales: ClassVar[tuple[float, ...]] = ()

    @classmethod
    def with_scales(cls, views: Sequence[LayerKV], scales: Sequence[float]
                    ) -> type[Fp8SlabKVPool]:
        if len(scales) != len(views):
            raise ConfigError(f"Fp8SlabKVPool: {len(scales)} kv scales for {len(views)} layers")
        return type(cls.__name__, (cls,), {"arena_views": tuple(views),
                                           "kv_scales": tuple(float(s) for s in scales)})

    def _get_key_buffer(self, layer_id: int) -> Fp8Reader:
        local = layer_id - self.start_layer
        return Fp8Reader(self.arena_views[local].k, self.kv_scales[local], self.dtype)

    def _get_value_buffer(self, layer_id: int) -> Fp8Reader:
        local = layer_id - self.start_layer
        return Fp8Reader(self.arena_views[local].v, self.kv_scales[local], self.dtype)

    def set_kv_buffer(self, layer: Any, loc_info: Any, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, k_scale: float | None = None,
                      v_scale: float | None = None, layer_id_override: int | None = None,
                      dcp_kv_mask: torch.Tensor | None = None) -> None:
        if dcp_kv_mask is not None:
            raise ConfigError("Fp8SlabKVPool: decode context parallelism is not supported")
        loc, _, _ = unwrap_write_loc(loc_info)
        local = self._local(layer, layer_id_override)
        view, scale = self.arena_views[local], self.kv_scales[local]
        for target, x in ((view.k, cache_k), (view.v, cache_v)):
            scaled = (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX)
            target[loc] = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(
                -1, self.head_num, self.head_dim)

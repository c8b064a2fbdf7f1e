"""`fineslab_kv4`: an SGLang attention backend whose decode reads the KV4 slots directly.

SGLang's triton and flashinfer backends index real K/V tensors; `Kv4SlabKVPool` hands out
`Kv4Reader`s (4-bit codes and a per-token (scale, zero) pair, dequantized on indexing), which
only torch_native reads. This backend is torch_native with one change: a decode step over a KV4
pool runs the Triton kernel `fineslab.quant.kv4_triton.kv4_decode_attention`, which unpacks the
codes of the request's slots in registers instead of dequantizing them into a copy. Prefill and
extend stay torch_native's (they read through the `Kv4Reader`s: the whole prefix is dequantized
per request, once per step, an extend kernel is future work).

What the decode step reads, for layer l (`fineslab.slabs.views`, `fineslab.quant.kv4`):

    reader = pool.get_key_buffer(l)      Kv4Reader(values, params, dtype)
    reader.values [slots, kv_heads, head_dim // 2] uint8    low nibble = even element
    reader.params [slots, kv_heads, 2] fp16                 (scale, zero)
    slots of request b = req_to_token[req_pool_indices[b], :seq_lens[b]]

Both are strided views of the arena (row stride = the format's token stride); the kernel takes
their strides, so nothing is copied. The new token's K/V are written first through the pool's
`set_kv_buffer` (quantized, as torch_native writes them), so the kernel sees the token it decodes.

Invariants
    output == torch_native's decode over the same pool, up to float32 summation order (the
    kernel dequantizes in float32; torch_native in the model dtype): equal in float32 to
    about 1e-6 (tests/precisions/test_kv4_backend.py)
    q_heads % kv_heads == 0 (GQA: query head h reads KV head h // (q_heads // kv_heads))

Falls back to torch_native's own decode (correct, not fast) for what the kernel does not cover:
a pool that is not KV4 (logged once when the backend is built), a sliding-window or
cross-attention layer, and K and V head sizes that differ. `logit_cap` is ignored, as
torch_native ignores it. CUDA graphs are not supported (torch_native has none either): a GPU
runtime disables them (`fineslab.quant.serving._prepare_kv`).

Cost: under the Triton interpreter (CPU, `TRITON_INTERPRET=1`) the kernel is slow (tests only);
on a GPU it reads head_dim / 2 + 4 bytes per token and head instead of the 2 * head_dim a
dequantized copy writes and reads. Not yet run on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from fineslab.errors import EnvironmentSetupError
from fineslab.quant.kv4 import KV4_ATTENTION_BACKEND as BACKEND_NAME
from fineslab.quant.kv4 import Kv4Reader
from fineslab.sglang_plugin.quant_pools import Kv4SlabKVPool

logger = logging.getLogger(__name__)

DecodeKernel = Callable[..., torch.Tensor]


class Kv4AttnBackend(TorchNativeAttnBackend):
    """torch_native, with decode over a `Kv4SlabKVPool` done by the KV4 Triton kernel."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self._kv4_kernel: DecodeKernel | None = None
        if isinstance(self.token_to_kv_pool, Kv4SlabKVPool):
            # Imported here: a process that never builds this backend never imports the kernel.
            from fineslab.quant.kv4_triton import kv4_decode_attention

            self._kv4_kernel = kv4_decode_attention
        else:
            logger.warning("%s: the KV pool is %s, not a KV4 pool; decoding as torch_native",
                           BACKEND_NAME, type(self.token_to_kv_pool).__name__)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: Any, forward_batch: Any, save_kv_cache: bool = True
                       ) -> torch.Tensor:
        """Write the new token's K/V, then attend over each request's KV4 slots with the
        kernel; returns [tokens, q_heads * head_dim] in q's dtype, as torch_native does."""
        kernel = self._kv4_kernel
        if kernel is None or not _kernel_covers(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        q_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, q_heads * head_dim)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        assert isinstance(k_cache, Kv4Reader) and isinstance(v_cache, Kv4Reader), \
            "a Kv4SlabKVPool hands out Kv4Readers"
        out = kernel(q.view(-1, q_heads, head_dim).contiguous(), k_cache.values,
                     k_cache.params, v_cache.values, v_cache.params,
                     self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                     forward_batch.seq_lens, float(layer.scaling))
        return out.to(q.dtype).reshape(-1, q_heads * head_dim)


def _kernel_covers(layer: Any) -> bool:
    """Whether the KV4 kernel computes this layer's decode (else torch_native's path does)."""
    window = layer.sliding_window_size
    return (not layer.is_cross_attention and (window is None or window < 0)
            and layer.qk_head_dim == layer.v_head_dim
            and layer.tp_q_head_num % layer.tp_k_head_num == 0)


def create_kv4_backend(model_runner: Any) -> Kv4AttnBackend:
    """The factory SGLang's attention registry calls for `--attention-backend fineslab_kv4`."""
    return Kv4AttnBackend(model_runner)


def register_kv4_backend() -> None:
    """Make `fineslab_kv4` an attention backend of this process's SGLang (idempotent): in the
    registry SGLang builds backends from (`register_attention_backend`, SGLang's own) and in
    the `--attention-backend` choices (`add_attention_backend_choices`).

    Raises EnvironmentSetupError when SGLang no longer keeps its backends in that registry."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.server_args import add_attention_backend_choices

    backends = getattr(attention_registry, "ATTENTION_BACKENDS", None)
    if not isinstance(backends, dict):
        raise EnvironmentSetupError(
            "fineslab plugin: sglang.srt.layers.attention.attention_registry has no "
            f"ATTENTION_BACKENDS dict; cannot register {BACKEND_NAME}")
    if BACKEND_NAME in backends:
        return
    attention_registry.register_attention_backend(BACKEND_NAME)(create_kv4_backend)
    if backends.get(BACKEND_NAME) is not create_kv4_backend:
        raise EnvironmentSetupError(
            f"fineslab plugin: SGLang's register_attention_backend did not add {BACKEND_NAME} "
            "to ATTENTION_BACKENDS")
    add_attention_backend_choices([BACKEND_NAME])
    logger.debug("fineslab plugin: registered attention backend %s", BACKEND_NAME)

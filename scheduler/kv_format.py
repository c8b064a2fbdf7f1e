"""Bytes of KV cache per token, from the KV block format.

    token_bytes = layers x 2 x (kv_heads / TP) x head_dim x bytes(kv dtype)
                  [+ layers x 2 x (kv_heads / TP) x (scale + zero) bytes, for INT4 KV]

INT4 KV (QoQ's KV4) stores a per-token, per-head FP16 scale and zero point beside the packed
values, for K and for V, so a head of 128 dims costs 64 + 4 = 68 bytes instead of 64. The same
formula is the arena's block format (DESIGN.md, "KV slab arena"); the numbers must agree.
"""

from __future__ import annotations

from fineslab.errors import ConfigError

#: Bytes per stored element of each KV dtype (INT4 packs two values per byte).
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5,
}
#: Per-token per-head quantization parameters (FP16 scale + FP16 zero) for group-quantized KV.
KV_PARAM_BYTES_PER_HEAD: dict[str, int] = {"int4": 4}


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                   tp: int = 1) -> int:
    """KV bytes one token occupies on one TP rank (K and V, every layer)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(f"unknown KV dtype {kv_dtype!r}; known: {sorted(KV_DTYPE_BYTES)}")
    if min(num_layers, num_kv_heads, head_dim, tp) < 1:
        raise ConfigError("layers, kv heads, head_dim and TP must all be >= 1")
    # With TP > kv_heads each rank still holds one (replicated) head.
    heads_per_rank = max(1, num_kv_heads // tp)
    value_bytes = head_dim * KV_DTYPE_BYTES[kv_dtype]
    param_bytes = KV_PARAM_BYTES_PER_HEAD.get(kv_dtype, 0)
    return int(num_layers * 2 * heads_per_rank * (value_bytes + param_bytes))

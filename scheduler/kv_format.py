"""Bytes of KV cache per token, by the name a profile uses for its KV dtype.

    token_bytes = layers x 2 x (kv_heads / TP) x head_dim x bytes(kv dtype)
                  [+ layers x 2 x (kv_heads / TP) x (scale + zero) bytes, for INT4 KV]

One formula: this is the arena's block format (`fineslab.slabs.formats.KVShape.token_bytes`),
read through the profiles' dtype names (`KVDtype.from_name`: fp16, bf16, fp32, fp8, int4).
"""

from __future__ import annotations

from fineslab.slabs.formats import KVDtype, KVShape


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                   tp: int = 1) -> int:
    """KV bytes one token occupies on one TP rank (K and V, every layer); ConfigError for an
    unknown dtype or a non-positive dimension."""
    return KVShape("kv_token_bytes", num_layers, num_kv_heads, head_dim,
                   KVDtype.from_name(kv_dtype), tp).token_bytes

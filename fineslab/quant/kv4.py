"""KV4 (QoQ's 4-bit KV cache): quantize on write, dequantize on read, in plain torch.

Glossary
    x        one token's K (or V) for one head: head_dim values
    q        4-bit unsigned code 0..15
    scale    fp16, (max(x) - min(x)) / 15 per token and head
    zero     fp16, min(x) per token and head (a float offset, not an integer zero point: that
             keeps the head's minimum exact and costs the same two bytes)

Byte layout of one token and head (the slab INT4 block format, `fineslab.slabs.views`):
    values  [head_dim // 2] uint8   byte i: low nibble = q[2i], high nibble = q[2i + 1]
    params  [2] fp16                (scale, zero)

Invariants
    x_hat = q * scale + zero,   |x - x_hat| <= scale / 2 + fp16 rounding of scale and zero
    quantize(dequantize(codes)) == codes for codes written by quantize (idempotent re-write)

Cost per token and head: head_dim / 2 + 4 bytes instead of 2 * head_dim (head_dim 64: 36 B vs
128 B, 3.56x the tokens per byte). Quantizing is one min/max reduction and one rounding pass;
reading dequantizes only the slots asked for (`Kv4Reader.__getitem__`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_CODE = 15
#: The SGLang attention backend the plugin registers to decode over this format on a GPU (its
#: Triton kernel, `fineslab.quant.kv4_triton`; `fineslab.sglang_plugin.kv4_backend`).
KV4_ATTENTION_BACKEND = "fineslab_kv4"
#: the smallest scale written: a constant head (max == min) gets codes 0 and x_hat == zero
MIN_SCALE = 1e-6


def quantize_kv4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (packed [..., head_dim // 2] uint8, params [..., 2] fp16)."""
    xf = x.to(torch.float32)
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    # Round scale and zero to fp16 first so that codes are chosen for the stored parameters.
    scale = ((hi - lo) / MAX_CODE).clamp(min=MIN_SCALE).to(torch.float16)
    zero = lo.to(torch.float16)
    codes = torch.round((xf - zero.float()) / scale.float()).clamp(0, MAX_CODE).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    params = torch.cat([scale, zero], dim=-1)
    return packed, params


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., head_dim // 2] uint8 -> [..., head_dim] uint8 codes 0..15."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_kv4(packed: torch.Tensor, params: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_kv4`: [..., head_dim] in `dtype`."""
    codes = unpack_codes(packed).to(torch.float32)
    scale = params[..., 0:1].to(torch.float32)
    zero = params[..., 1:2].to(torch.float32)
    return (codes * scale + zero).to(dtype)


def write_kv4(values: torch.Tensor, params: torch.Tensor, loc: torch.Tensor,
              x: torch.Tensor) -> None:
    """Quantize x [n, heads, head_dim] into slots `loc` of one layer's views (in place)."""
    packed, new_params = quantize_kv4(x)
    values[loc] = packed
    params[loc] = new_params


@dataclass(frozen=True)
class Kv4Reader:
    """One layer's K or V as SGLang's torch_native backend reads it: `reader[slots]` gives the
    dequantized [len(slots), heads, head_dim] tensor in `dtype`; nothing else is dequantized."""

    values: torch.Tensor
    params: torch.Tensor
    dtype: torch.dtype

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        return dequantize_kv4(self.values[slots], self.params[slots], self.dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        rows, heads, half = self.values.shape
        return rows, heads, 2 * half

    @property
    def device(self) -> torch.device:
        return self.values.device

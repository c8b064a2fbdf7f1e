"""Triton W4A8 GEMM that reads QoQ's packed 4-bit weights directly (no INT8 copy of the weight).

y[t, n] = s_x[t] * s1[n] * sum_k x_q[t, k] * v_hat[n, k] + bias[n], the numerics of
`fineslab.quant.qoq.w4a8_linear` (glossary, layout and invariants in `fineslab.quant.qoq`).

One program per (BLOCK_T tokens, BLOCK_N output channels); it walks K in tiles of BLOCK_K, a
multiple of the group size G, so that a tile holds GROUPS_PER_TILE = BLOCK_K / G whole groups:

    packed tile [BLOCK_N, BLOCK_K / 2] uint8     byte j: low nibble k0 + 2j, high k0 + 2j + 1
        -> lo, hi [BLOCK_N, GROUPS_PER_TILE, G / 2]       (byte j lies in group j // (G / 2))
        -> (lo - z) * s2, (hi - z) * s2                   level 2, z and s2 [BLOCK_N, GROUPS]
        -> interleave -> v_hat tile [BLOCK_N, BLOCK_K] int8   column c is k0 + c again
    acc [BLOCK_T, BLOCK_N] int32 += tl.dot(x_q tile [BLOCK_T, BLOCK_K] int8, v_hat tile^T)

Invariants
    grid = (cdiv(T, BLOCK_T), cdiv(N, BLOCK_N));  BLOCK_K % G == 0;  G a power of two
    acc == int8_matmul(x_q, dequantize_qoq_to_int8(w))   exactly (integers, K * 127^2 < 2^31)
    out == (float32(acc) * s_x[t]) * s1[n] + bias[n], in that order (as w4a8_linear)
The K tail (K % BLOCK_K) loads x as 0, so whatever the masked weight columns hold adds 0.
The kernel trusts the weight's invariants (|v_hat| <= 127, so the cast to int8 is exact):
`QoQWeight.check_integrity` is the caller's job, once at load.

Cost: reads K / 2 + 2 K / G + 2 bytes of weight per output channel (0.26 of bf16 at G = 128)
plus T K bytes of activations per BLOCK_N columns, and no N K INT8 cache. Tile sizes are
fixed heuristics (`_blocks`), not tuned: no GPU was lent to the session that wrote this. On
CPU it runs only under the Triton interpreter (`TRITON_INTERPRET=1`, set before triton is
imported; slow, so the tests use small shapes); there `tl.dot` on int8 tiles returns the
exact int32 product, which the tests check against `int8_matmul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fineslab.errors import ConfigError
from fineslab.quant.qoq import QoQWeight, quantize_activations_int8

#: Smallest K tile: tl.dot needs every dimension >= 16, and a wider tile halves the loop trips.
MIN_BLOCK_K = 128


@triton.jit
def _bf16_round_to_nearest_even(y):  # type: ignore[no-untyped-def]
    """float32 -> the float32 nearest a bf16, ties to even (finite y), so that the cast to bf16
    after it is exact. GPU casts round so already; the interpreter truncates (triton 3.9),
    and this keeps its bf16 outputs equal to torch's `.to(torch.bfloat16)`."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _w4a8_kernel(  # type: ignore[no-untyped-def]
    x_ptr, sx_ptr, w_ptr, s2_ptr, z_ptr, s1_ptr, bias_ptr, out_ptr,
    num_tokens, out_features, in_features,
    stride_xt, stride_wn, stride_gn, stride_ot,
    GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr,
):
    GROUPS_PER_TILE: tl.constexpr = BLOCK_K // GROUP
    HALF_GROUP: tl.constexpr = GROUP // 2
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_t = offs_t < num_tokens
    mask_n = offs_n < out_features
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, GROUPS_PER_TILE)
    num_groups = in_features // GROUP
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, in_features, BLOCK_K):
        # -- activations: [BLOCK_T, BLOCK_K] int8, 0 past K ---------------------------------
        mask_k = k0 + offs_k < in_features
        x_rows = x_ptr + offs_t[:, None] * stride_xt + (k0 + offs_k)[None, :]
        x = tl.load(x_rows, mask=mask_t[:, None] & mask_k[None, :], other=0)
        # -- weights: unpack the nibbles, level 2 per group, back to K order ----------------
        w_rows = w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + offs_byte)[None, :]
        mask_b = mask_n[:, None] & (k0 // 2 + offs_byte < in_features // 2)[None, :]
        packed = tl.load(w_rows, mask=mask_b, other=0).to(tl.int32)
        group = k0 // GROUP + offs_g
        g_rows = offs_n[:, None] * stride_gn + group[None, :]
        mask_g = mask_n[:, None] & (group < num_groups)[None, :]
        s2 = tl.load(s2_ptr + g_rows, mask=mask_g, other=0).to(tl.int32)[:, :, None]
        z = tl.load(z_ptr + g_rows, mask=mask_g, other=0).to(tl.int32)[:, :, None]
        lo = tl.reshape(packed & 15, (BLOCK_N, GROUPS_PER_TILE, HALF_GROUP))
        hi = tl.reshape(packed >> 4, (BLOCK_N, GROUPS_PER_TILE, HALF_GROUP))
        v_even = tl.reshape((lo - z) * s2, (BLOCK_N, BLOCK_K // 2))
        v_odd = tl.reshape((hi - z) * s2, (BLOCK_N, BLOCK_K // 2))
        v_hat = tl.interleave(v_even, v_odd).to(tl.int8)
        acc += tl.dot(x, tl.trans(v_hat), out_dtype=tl.int32)
    # -- epilogue: int32 as it is, or the scales and bias in float32 -------------------------
    out_rows = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :]
    mask_out = mask_t[:, None] & mask_n[None, :]
    if SCALE:
        s_x = tl.load(sx_ptr + offs_t, mask=mask_t, other=0.0)
        s1 = tl.load(s1_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * s_x[:, None] * s1[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if out_ptr.dtype.element_ty == tl.bfloat16:
            y = _bf16_round_to_nearest_even(y)
        tl.store(out_rows, y.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        tl.store(out_rows, acc, mask=mask_out)


def supports_group_size(group_size: int) -> bool:
    """Whether the kernel takes groups of `group_size`: a power of two (Triton tile shapes are
    powers of two, and a K tile must hold whole groups)."""
    return group_size >= 2 and group_size & (group_size - 1) == 0


def _blocks(num_tokens: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_K). Few tokens (decode): narrow N tiles, so that a 4096-wide
    layer still spreads over 128 programs; many tokens: wider tiles reuse each weight tile."""
    block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_n = 32 if num_tokens <= 16 else 64 if num_tokens <= 64 else 128
    return block_t, block_n, max(group_size, MIN_BLOCK_K)


def _launch(x_q: torch.Tensor, s_x: torch.Tensor, w: QoQWeight, bias: torch.Tensor | None,
            out: torch.Tensor, scale: bool) -> torch.Tensor:
    out_features, in_features = w.shape
    num_tokens = x_q.shape[0]
    if x_q.dtype != torch.int8 or x_q.dim() != 2 or x_q.shape[1] != in_features:
        raise ConfigError(f"w4a8_gemm: x_q must be int8 [T, {in_features}], got "
                          f"{x_q.dtype} {tuple(x_q.shape)}")
    if tuple(s_x.shape) != (num_tokens,) or s_x.dtype != torch.float32:
        raise ConfigError(f"w4a8_gemm: s_x must be float32 [{num_tokens}], got {s_x.dtype} "
                          f"{tuple(s_x.shape)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ConfigError(f"w4a8_gemm: bias shape {tuple(bias.shape)}, want ({out_features},)")
    if not supports_group_size(w.group_size):
        raise ConfigError(f"w4a8_gemm: group size {w.group_size} is not a power of two")
    x_q, packed = x_q.contiguous(), w.packed.contiguous()
    s2, z = w.s2.contiguous(), w.z.contiguous()
    block_t, block_n, block_k = _blocks(num_tokens, w.group_size)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(out_features, block_n))
    _w4a8_kernel[grid](
        x_q, s_x, packed, s2, z, w.s1, bias if bias is not None else w.s1, out,
        num_tokens, out_features, in_features,
        x_q.stride(0), packed.stride(0), s2.stride(0), out.stride(0),
        GROUP=w.group_size, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, SCALE=scale,
    )
    return out


def w4a8_gemm(x_q: torch.Tensor, s_x: torch.Tensor, w: QoQWeight,
              bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_q int8 [T, K], s_x float32 [T] -> y [T, N] in `out_dtype`:
    (float32(x_q @ v_hat^T) * s_x[t]) * s1[n] + bias[n], the INT32 product exact.

    Raises ConfigError for operands of the wrong dtype or shape, or a group size that is not
    a power of two."""
    out = torch.empty(x_q.shape[0], w.shape[0], dtype=out_dtype, device=x_q.device)
    return _launch(x_q, s_x, w, bias, out, scale=True)


def w4a8_gemm_int32(x_q: torch.Tensor, w: QoQWeight) -> torch.Tensor:
    """The kernel's INT32 accumulator alone, [T, N]: x_q @ v_hat^T (what tests compare with
    `int8_matmul` for equality)."""
    out = torch.empty(x_q.shape[0], w.shape[0], dtype=torch.int32, device=x_q.device)
    dummy_scale = torch.empty(x_q.shape[0], dtype=torch.float32, device=x_q.device)
    return _launch(x_q, dummy_scale, w, None, out, scale=False)


def w4a8_linear_triton(x: torch.Tensor, w: QoQWeight,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """`qoq.w4a8_linear` through the Triton GEMM: [..., K] float -> [..., N] in x.dtype
    (per-token INT8 activations by `quantize_activations_int8`, then `w4a8_gemm`)."""
    out_features, in_features = w.shape
    if x.shape[-1] != in_features:
        raise ConfigError(f"w4a8_linear_triton: x has {x.shape[-1]} features, the weight takes "
                          f"{in_features}")
    x_q, s_x = quantize_activations_int8(x.reshape(-1, in_features))
    y = w4a8_gemm(x_q, s_x, w, bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], out_features)

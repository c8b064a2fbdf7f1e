"""Triton decode attention that reads KV4 slots directly (no dequantized copy of the cache).

One program per (request, query head): it walks the request's token slots in blocks of
BLOCK_N, unpacks each slot's 4-bit K and V for its KV head, applies the per-token (scale,
zero), and keeps an online softmax (running max `m`, running sum `l`, accumulator `acc`).

Layout it reads (`fineslab.quant.kv4`, `fineslab.slabs.views`):
    k_values[slot, kv_head, i]  uint8: low nibble = element 2i, high nibble = element 2i + 1
    k_params[slot, kv_head, :]  fp16 (scale, zero);  k = code * scale + zero
    slot of token t of request b = req_to_token[req_pool_indices[b], t]
The even and odd elements of q, k and v are kept as two half-width vectors, so the kernel never
interleaves nibbles: q.k = q_even.k_even + q_odd.k_odd, and out_even/out_odd are stored apart.

Invariants
    grid = (batch, q_heads); kv_head = q_head // (q_heads // kv_heads)
    out[b, h] == softmax(q[b, h] . K_hat^T * sm_scale) . V_hat   (K_hat, V_hat dequantized)

Cost: reads head_dim / 2 + 4 bytes per token and head instead of 2 * head_dim. On CPU it runs
under the Triton interpreter (`TRITON_INTERPRET=1`, slow: tests use a few short requests);
`kv4_decode_attention_reference` is the plain-torch twin the tests compare it with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fineslab.quant.kv4 import dequantize_kv4


@triton.jit
def _kv4_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr, out_ptr, kv_ptr, kp_ptr, vv_ptr, vp_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    sm_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_kv0, stride_kv1,
    stride_kp0, stride_kp1, stride_vv0, stride_vv1, stride_vp0, stride_vp1, stride_rt,
    GROUP: tl.constexpr, HALF_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq_len = tl.load(seq_lens_ptr + batch)
    req = tl.load(req_idx_ptr + batch)
    offs_d = tl.arange(0, HALF_D)
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    q_even = tl.load(q_base + 2 * offs_d).to(tl.float32)
    q_odd = tl.load(q_base + 2 * offs_d + 1).to(tl.float32)

    m_i = -float("inf")
    l_i = 0.0
    acc_even = tl.zeros([HALF_D], dtype=tl.float32)
    acc_odd = tl.zeros([HALF_D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        slots = tl.load(req_to_token_ptr + req * stride_rt + offs_n, mask=mask_n, other=0)
        slots = slots.to(tl.int64)
        # -- K: unpack, dequantize, score ------------------------------------------------
        k_rows = kv_ptr + slots[:, None] * stride_kv0 + kv_head * stride_kv1 + offs_d[None, :]
        k_bytes = tl.load(k_rows, mask=mask_n[:, None], other=0).to(tl.int32)
        k_par = kp_ptr + slots * stride_kp0 + kv_head * stride_kp1
        k_scale = tl.load(k_par, mask=mask_n, other=0.0).to(tl.float32)
        k_zero = tl.load(k_par + 1, mask=mask_n, other=0.0).to(tl.float32)
        k_even = (k_bytes & 15).to(tl.float32) * k_scale[:, None] + k_zero[:, None]
        k_odd = (k_bytes >> 4).to(tl.float32) * k_scale[:, None] + k_zero[:, None]
        scores = tl.sum(k_even * q_even[None, :] + k_odd * q_odd[None, :], axis=1) * sm_scale
        scores = tl.where(mask_n, scores, -float("inf"))
        # -- online softmax ---------------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        # -- V: unpack, dequantize, accumulate ----------------------------------------------
        v_rows = vv_ptr + slots[:, None] * stride_vv0 + kv_head * stride_vv1 + offs_d[None, :]
        v_bytes = tl.load(v_rows, mask=mask_n[:, None], other=0).to(tl.int32)
        v_par = vp_ptr + slots * stride_vp0 + kv_head * stride_vp1
        v_scale = tl.load(v_par, mask=mask_n, other=0.0).to(tl.float32)
        v_zero = tl.load(v_par + 1, mask=mask_n, other=0.0).to(tl.float32)
        v_even = (v_bytes & 15).to(tl.float32) * v_scale[:, None] + v_zero[:, None]
        v_odd = (v_bytes >> 4).to(tl.float32) * v_scale[:, None] + v_zero[:, None]
        acc_even = acc_even * alpha + tl.sum(p[:, None] * v_even, axis=0)
        acc_odd = acc_odd * alpha + tl.sum(p[:, None] * v_odd, axis=0)
        m_i = m_new
    o_base = out_ptr + batch * stride_ob + head * stride_oh
    tl.store(o_base + 2 * offs_d, acc_even / l_i)
    tl.store(o_base + 2 * offs_d + 1, acc_odd / l_i)


def kv4_decode_attention(q: torch.Tensor, k_values: torch.Tensor, k_params: torch.Tensor,
                         v_values: torch.Tensor, v_params: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float,
                         block_n: int = 32) -> torch.Tensor:
    """Decode attention over KV4 slots: q [batch, q_heads, head_dim] -> same shape, float32.

    Every request must have seq_len >= 1 (SGLang's decode always has the new token's KV).
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = k_values.shape[1]
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    for t in (k_values, v_values, k_params, v_params):
        if t.stride(2) != 1:
            raise ValueError("KV4 views need a contiguous last dimension")
    _kv4_decode_kernel[(batch, q_heads)](
        q, out, k_values, k_params, v_values, v_params, req_to_token, req_pool_indices,
        seq_lens, sm_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_values.stride(0), k_values.stride(1), k_params.stride(0), k_params.stride(1),
        v_values.stride(0), v_values.stride(1), v_params.stride(0), v_params.stride(1),
        req_to_token.stride(0), GROUP=q_heads // kv_heads, HALF_D=head_dim // 2,
        BLOCK_N=block_n,
    )
    return out


def kv4_decode_attention_reference(q: torch.Tensor, k_values: torch.Tensor,
                                   k_params: torch.Tensor, v_values: torch.Tensor,
                                   v_params: torch.Tensor, req_to_token: torch.Tensor,
                                   req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                                   sm_scale: float) -> torch.Tensor:
    """The same attention in plain torch (dequantize the request's slots, then softmax)."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k_values.shape[1]
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        slots = req_to_token[req_pool_indices[b], : int(seq_lens[b])].long()
        k = dequantize_kv4(k_values[slots], k_params[slots]).repeat_interleave(group, dim=1)
        v = dequantize_kv4(v_values[slots], v_params[slots]).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out

"""KV4 quantization (plain torch) and the Triton KV4 decode kernel under the interpreter.

Bounds: per element |x - x_hat| <= scale / 2 + 1e-2 (fp16 rounding of scale and zero);
attention over KV4 vs over the exact bf16 K/V: cosine >= 0.99 per head; Triton kernel vs the
plain-torch reference on the same KV4 slots: max abs difference <= 1e-4.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from fineslab.quant.kv4 import Kv4Reader, dequantize_kv4, quantize_kv4, unpack_codes


def _kv(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_error_within_half_a_step() -> None:
    x = _kv(0, 200, 2, 64)
    packed, params = quantize_kv4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (200, 2, 32)
    assert params.dtype == torch.float16 and params.shape == (200, 2, 2)
    err = (dequantize_kv4(packed, params) - x).abs()
    assert bool((err <= params[..., :1].float() / 2 + 1e-2).all())


def test_nibble_order_low_is_even_element() -> None:
    x = torch.zeros(1, 1, 4)
    x[0, 0, 1] = 15.0  # odd element max -> code 15 in the high nibble of byte 0
    packed, _ = quantize_kv4(x)
    assert int(packed[0, 0, 0]) == 0xF0 and int(packed[0, 0, 1]) == 0x00


def test_requantizing_is_idempotent() -> None:
    packed, params = quantize_kv4(_kv(1, 50, 4, 64))
    again, params2 = quantize_kv4(dequantize_kv4(packed, params))
    assert torch.equal(unpack_codes(again), unpack_codes(packed))
    assert torch.equal(params, params2)


def test_reader_dequantizes_only_asked_slots() -> None:
    x = _kv(2, 10, 2, 64)
    packed, params = quantize_kv4(x)
    reader = Kv4Reader(packed, params, torch.bfloat16)
    slots = torch.tensor([7, 2])
    got = reader[slots]
    assert got.dtype == torch.bfloat16 and got.shape == (2, 2, 64) and reader.shape == (10, 2, 64)
    assert torch.equal(got, dequantize_kv4(packed[slots], params[slots], torch.bfloat16))


def test_attention_over_kv4_close_to_exact() -> None:
    q, k, v = _kv(3, 4, 1, 64), _kv(4, 4, 300, 64), _kv(5, 4, 300, 64)
    exact = torch.softmax(q @ k.transpose(1, 2) / 8, -1) @ v
    kq = dequantize_kv4(*quantize_kv4(k))
    vq = dequantize_kv4(*quantize_kv4(v))
    approx = torch.softmax(q @ kq.transpose(1, 2) / 8, -1) @ vq
    cos = torch.nn.functional.cosine_similarity(exact.flatten(1), approx.flatten(1))
    assert float(cos.min()) >= 0.99, f"KV4 attention cosine {cos.tolist()}"


_KERNEL_CHECK = """
import torch
from fineslab.quant.kv4 import quantize_kv4
from fineslab.quant.kv4_triton import kv4_decode_attention, kv4_decode_attention_reference

def kv(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3

slots, kv_heads, head_dim, q_heads = 300, 2, 64, 4
kp, ks = quantize_kv4(kv(6, slots, kv_heads, head_dim))
vp, vs = quantize_kv4(kv(7, slots, kv_heads, head_dim))
gen = torch.Generator().manual_seed(8)
req_to_token = torch.randperm(slots, generator=gen).to(torch.int32).reshape(3, 100)
req_idx = torch.tensor([2, 0], dtype=torch.int64)
seq_lens = torch.tensor([77, 5], dtype=torch.int32)  # crosses BLOCK_N, and a short one
q = kv(9, 2, q_heads, head_dim)
args = (q, kp, ks, vp, vs, req_to_token, req_idx, seq_lens, 0.125)
diff = (kv4_decode_attention(*args) - kv4_decode_attention_reference(*args)).abs().max()
print("MAXDIFF", float(diff))
"""


def test_triton_kernel_matches_reference_under_interpreter() -> None:
    """A fresh process: Triton must be imported with TRITON_INTERPRET=1 already set."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    diff = float(done.stdout.split("MAXDIFF")[-1])
    assert diff <= 1e-4, f"Triton KV4 kernel differs from the reference by {diff}"

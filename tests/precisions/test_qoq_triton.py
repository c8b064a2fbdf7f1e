"""The Triton W4A8 GEMM (fineslab.quant.qoq_triton) against the torch reference of qoq.py.

On CPU the kernel runs under the Triton interpreter, which must be set before triton is
imported, so one fresh process (`TRITON_INTERPRET=1`) runs every case and prints one JSON
line per case; the tests below read them. Each case checks the kernel's INT32 accumulator for
equality with `int8_matmul` on the dequantized INT8 weight, and its output for equality with
`w4a8_linear` (the float32 epilogue does the same operations in the same order). Measured on
the 2-core CI-like EPYC (torch 2.13, triton 3.9): that process takes 5 to 13 s and the file 7 to
28 s, depending on the machine's load. The negative controls run the kernel on a corrupted
copy of the weight (nibbles swapped, one zero point off by one) and assert that the same
comparison reports a difference.

The gpu-marked tests run the compiled kernel at K = N = 4096 and print its time against the
torch path of the SGLang method's CPU branch (cached INT8 weight, `int8_matmul`), and check
that the SGLang method takes the kernel for a layer on CUDA. Neither has run on a GPU yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

#: (name, T, N, K, G, bias, out dtype): T = 1 and an odd T, N not a multiple of BLOCK_N (32 or
#: 64), K with a tail past the last 128-wide tile, groups from 8 to 256, and the three
#: activation dtypes (bf16 checks the epilogue's round-to-nearest-even).
CASES = [
    ("decode-g64", 1, 40, 256, 64, False, "float32"),
    ("odd-t-g128-bias", 7, 100, 384, 128, True, "float32"),
    ("k-tail-g64-bias", 7, 33, 192, 64, True, "float32"),
    ("many-tokens-g128", 40, 70, 256, 128, True, "float32"),
    ("g256", 3, 24, 512, 256, False, "float32"),
    ("g8-bf16", 5, 20, 64, 8, True, "bfloat16"),
    ("g32-fp16", 2, 48, 128, 32, True, "float16"),
]

_KERNEL_CHECK = """
import json, sys, torch
from fineslab.quant.qoq import (QoQConfig, QoQWeight, dequantize_qoq_to_int8, int8_matmul,
                                quantize_activations_int8, quantize_qoq, w4a8_linear)
from fineslab.quant.qoq_triton import w4a8_gemm_int32, w4a8_linear_triton

def corrupt(w, how):
    if how == "swapped-nibbles":
        packed = (w.packed << 4) | (w.packed >> 4)
        return QoQWeight(packed, w.s2, w.z, w.s1, w.group_size)
    z = w.z.clone()
    z[0, 0] += 1
    return QoQWeight(w.packed, w.s2, z, w.s1, w.group_size)

for name, t, n, k, g, with_bias, dtype in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(t * 1000 + n)
    w = quantize_qoq(torch.randn(n, k, generator=gen), QoQConfig(group_size=g))
    x = torch.randn(t, k, generator=gen).to(getattr(torch, dtype))
    bias = torch.randn(n, generator=gen) if with_bias else None
    x_q, _ = quantize_activations_int8(x)
    want_acc = int8_matmul(x_q, dequantize_qoq_to_int8(w), use_int_mm=False)
    got, want = w4a8_linear_triton(x, w, bias), w4a8_linear(x, w, bias, use_int_mm=False)
    row = {"name": name, "acc_equal": torch.equal(w4a8_gemm_int32(x_q, w), want_acc),
           "out_equal": torch.equal(got, want), "out_dtype": str(got.dtype),
           "max_diff": float((got.float() - want.float()).abs().max())}
    for how in ("swapped-nibbles", "zero-off-by-one"):
        row[how] = torch.equal(w4a8_gemm_int32(x_q, corrupt(w, how)), want_acc)
    print("CASE", json.dumps(row), flush=True)
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    """Every case's results from one process running the kernel under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK, json.dumps(CASES)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CASE ")]
    assert len(rows) == len(CASES), f"{len(rows)} of {len(CASES)} cases ran:\n{done.stdout}"
    assert time.perf_counter() - start < 120, "the interpreter cases must stay small"
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_reference_under_interpreter(interpreted: dict[str, dict[str, Any]],
                                                   case: tuple[Any, ...]) -> None:
    row = interpreted[case[0]]
    assert row["acc_equal"], f"{case}: the INT32 accumulator must equal int8_matmul exactly"
    assert row["out_equal"], (f"{case}: output differs from w4a8_linear by {row['max_diff']}; "
                              "the epilogue must scale as the reference does")
    assert row["out_dtype"] == f"torch.{case[6]}", "the output keeps the activations' dtype"


@pytest.mark.parametrize("how", ["swapped-nibbles", "zero-off-by-one"])
def test_corrupted_weight_is_caught(interpreted: dict[str, dict[str, Any]], how: str) -> None:
    caught = [name for name, row in interpreted.items() if not row[how]]
    assert len(caught) == len(CASES), (f"{how}: the accumulator comparison must fail for every "
                                       f"case, failed only for {caught}")


def test_bad_operands_raise_config_error() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = """
import torch
from fineslab.errors import ConfigError
from fineslab.quant.qoq import QoQConfig, quantize_qoq
from fineslab.quant.qoq_triton import w4a8_gemm
w = quantize_qoq(torch.randn(8, 96), QoQConfig(group_size=96))
w64 = quantize_qoq(torch.randn(8, 128), QoQConfig(group_size=64))
x_q, s_x = torch.zeros(2, 128, dtype=torch.int8), torch.ones(2)
for args, words in (((x_q[:, :96], s_x, w), "power of two"), ((x_q.float(), s_x, w64), "int8"),
                    ((x_q, s_x[:1], w64), "s_x"), ((x_q, s_x, w64, torch.ones(3)), "bias")):
    try:
        w4a8_gemm(*args)
    except ConfigError as err:
        assert words in str(err), err
    else:
        raise AssertionError(words)
print("OK")
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]


def _cuda_ms(fn: Any, reps: int = 20) -> float:
    """Median milliseconds of `fn()` on the current CUDA stream (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16, 128])
def test_kernel_on_cuda_matches_reference(num_tokens: int,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from fineslab.quant.qoq import (
        dequantize_qoq_to_int8,
        int8_matmul,
        quantize_activations_int8,
        quantize_qoq,
        w4a8_linear,
    )
    from fineslab.quant.qoq_triton import w4a8_gemm, w4a8_gemm_int32

    gen = torch.Generator().manual_seed(num_tokens)
    w = quantize_qoq(torch.randn(4096, 4096, generator=gen).cuda())
    x = torch.randn(num_tokens, 4096, generator=gen).cuda()
    bias = torch.randn(4096, generator=gen).cuda()
    x_q, s_x = quantize_activations_int8(x)
    w_int8, s1 = dequantize_qoq_to_int8(w), w.s1.float()
    assert torch.equal(w4a8_gemm_int32(x_q, w), int8_matmul(x_q, w_int8)), "exact INT32 product"
    got, want = w4a8_gemm(x_q, s_x, w, bias), w4a8_linear(x, w, bias)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5), float((got - want).abs().max())

    def torch_path() -> torch.Tensor:
        return int8_matmul(x_q, w_int8).float() * s_x[:, None] * s1[None, :] + bias

    triton_ms = _cuda_ms(lambda: w4a8_gemm(x_q, s_x, w, bias))
    torch_ms = _cuda_ms(torch_path)
    with capsys.disabled():
        print(f"\nW4A8 [{num_tokens}, 4096] x [4096, 4096] on {torch.cuda.get_device_name(0)}: "
              f"triton {triton_ms:.3f} ms, torch int8 path {torch_ms:.3f} ms")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sglang_method_takes_triton_on_cuda() -> None:
    pytest.importorskip("sglang")
    from fineslab.quant.qoq import QoQConfig, QoQWeight, quantize_qoq, w4a8_linear
    from fineslab.quant.qoq_checkpoint import qoq_tensors
    from fineslab.sglang_plugin.qoq_method import QoQLinearConfig, QoQLinearMethod

    gen = torch.Generator().manual_seed(5)
    w = quantize_qoq(torch.randn(512, 1024, generator=gen), QoQConfig(group_size=128))
    method = QoQLinearMethod(QoQLinearConfig(group_size=128))
    linear = torch.nn.Module()
    method.create_weights(linear, 1024, [512], 1024, 512, torch.bfloat16)
    for name, tensor in qoq_tensors("", w).items():
        getattr(linear, name[1:]).data.copy_(tensor)
    linear.cuda()
    method.process_weights_after_loading(linear)
    assert not hasattr(linear, "qoq_weight_int8"), "no INT8 cache where Triton serves the layer"
    x = torch.randn(3, 1024, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(512, generator=gen).cuda()
    got = method.apply(linear, x, bias).float()
    w_cuda = QoQWeight(w.packed.cuda(), w.s2.cuda(), w.z.cuda(), w.s1.cuda(), w.group_size)
    want = w4a8_linear(x, w_cuda, bias).float()
    # bf16 outputs: one bf16 step (2**-8 relative) where the GPU's fused multiply-add moves a
    # float32 value across a rounding boundary.
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), float((got - want).abs().max())

"""The gpu-lite stand-in's torch fallbacks for SGLang's compiled-at-first-use FP8 and AWQ kernels
(`fineslab/gpu_lite/fallbacks.py`): each against a plain reference, with a control that the
comparison catches a wrong result, and SGLang's own callers reaching them through the stand-in.

Run on CPU: the kernels are plain torch, registered for CPU as for CUDA.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from fineslab.gpu_lite import fallbacks
from fineslab.quant.awq import pack_int4, quantize_linear

REPO = Path(__file__).resolve().parents[1]
E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def ops() -> object:
    """The fallbacks in a namespace of this test's own (SGLang's `sglang` one is left alone)."""
    namespace = f"fineslab_test_{uuid.uuid4().hex[:8]}"
    assert set(fallbacks.register(namespace).values()) == {"defined"}
    return getattr(torch.ops, namespace)


def _activations(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 96, generator=gen) * torch.logspace(-3, 2, 9)[:, None]
    x[4] = 0.0  # an all-zero row: a positive scale, zeros out
    x[6, 17] = 300.0  # an outlier sets its row's scale
    return x.to(dtype)


def per_token_violations(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> list[str]:
    """What is wrong with (q, scale) as the per-token e4m3 quantization of x, checked row by row
    in float64: scale = amax / 448 (rel 1e-6; a positive floor for a zero row), and every
    element within e4m3's rounding: |q * s - x| <= 2^-4 |x| + s 2^-9 (3 mantissa bits;
    subnormals)."""
    problems = []
    xs, qs, ss = x.double(), q.double(), scale.double().view(-1)
    for row in range(x.shape[0]):
        amax = float(xs[row].abs().max())
        expected = amax / E4M3_MAX
        if amax == 0.0:
            if not 0.0 < float(ss[row]) <= 1e-6 or bool(qs[row].any()):
                problems.append(f"row {row}: zero row gave scale {float(ss[row])}")
            continue
        if abs(float(ss[row]) - expected) > 1e-6 * expected:
            problems.append(f"row {row}: scale {float(ss[row])}, expected {expected}")
            continue
        err = (qs[row] * ss[row] - xs[row]).abs()
        bound = xs[row].abs() * 2 ** -4 + ss[row] * 2 ** -9
        if bool((err > bound).any()):
            problems.append(f"row {row}: error {float((err - bound).max())} past e4m3 rounding")
    return problems


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_token_quant_fp8_matches_reference(ops: object, dtype: torch.dtype) -> None:
    x = _activations(dtype)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(x.shape[0], 1)
    ops.per_token_quant_fp8(x, q, scale)  # type: ignore[attr-defined]
    assert per_token_violations(x, q, scale) == [], "per-token FP8 quant off its reference"
    assert float(q.float().abs().amax(dim=1)[6]) == E4M3_MAX, "a row's amax maps to 448"


def test_the_per_token_check_catches_wrong_quantizations(ops: object) -> None:
    x = _activations(torch.bfloat16)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(x.shape[0], 1)
    ops.per_token_quant_fp8(x, q, scale)  # type: ignore[attr-defined]
    per_tensor = (x.float().abs().max() / E4M3_MAX).expand(x.shape[0], 1)
    wrong = {
        "scales of the next row": (q, scale.roll(1, 0)),
        "one tensor-wide scale": ((x.float() / per_tensor).to(torch.float8_e4m3fn), per_tensor),
        "fnuz's 240 as the maximum": (q, scale * E4M3_MAX / 240.0),
        "a code off by one step": (torch.where(torch.arange(x.numel()).view(x.shape) == 500,
                                               (q.float() * 1.25).to(q.dtype), q), scale),
    }
    for how, (bad_q, bad_scale) in wrong.items():
        assert per_token_violations(x, bad_q, bad_scale), f"the check missed {how}"


def _awq_layer(out_features: int = 128, in_features: int = 256, group: int = 64) -> tuple:
    gen = torch.Generator().manual_seed(1)
    ql = quantize_linear(torch.randn(out_features, in_features, generator=gen), group)
    return ql, pack_int4(ql.values), pack_int4(ql.zeros)


def test_awq_dequantize_matches_reference(ops: object) -> None:
    ql, qweight, qzeros = _awq_layer()
    got = ops.awq_dequantize(qweight, ql.scales, qzeros)  # type: ignore[attr-defined]
    assert got.dtype == torch.float16 and got.shape == (256, 128)
    assert torch.equal(got, ql.dequantize()), "AWQ dequantization differs from the unpacked " \
        "reference (QuantizedLinear.dequantize)"
    bf16 = ops.awq_dequantize(qweight, ql.scales.to(torch.bfloat16), qzeros)  # type: ignore
    assert bf16.dtype == torch.bfloat16


def test_the_awq_comparison_catches_wrong_packing(ops: object) -> None:
    ql, qweight, qzeros = _awq_layer()
    reference = ql.dequantize()
    natural_order = torch.zeros_like(qweight)
    for nibble in range(8):  # packed in plain column order instead of AWQ's interleave
        natural_order |= (ql.values.view(256, 16, 8)[:, :, nibble] << (4 * nibble)).to(
            torch.int32)
    wrong = {
        "columns in natural order": (natural_order, ql.scales, qzeros),
        "zero points off by one": (qweight, ql.scales, pack_int4((ql.zeros + 1) % 16)),
        "groups' scales swapped": (qweight, ql.scales.flip(0), qzeros),
    }
    for how, args in wrong.items():
        got = ops.awq_dequantize(*args)  # type: ignore[attr-defined]
        assert not torch.equal(got, reference), f"the comparison missed {how}"


def _run_with_stubs(tmp_path: Path, script: str,
                    with_stand_in: bool) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter whose `sgl_kernel` is the gpu-lite stand-in (plus the CPU
    mode's torchvision stand-in, which SGLang's imports need on this machine)."""
    stubs = tmp_path / "stubs"
    cpu_stubs = REPO / "fineslab" / "cpu_mode" / "stubs"
    shutil.copytree(cpu_stubs / "torchvision", stubs / "torchvision")
    shutil.copy2(cpu_stubs / "_fineslab_stubpkg.py", stubs)
    if with_stand_in:
        shutil.copytree(REPO / "fineslab" / "gpu_lite" / "stubs" / "sgl_kernel",
                        stubs / "sgl_kernel")
    env = {**os.environ, "PYTHONPATH": f"{stubs}:{REPO}"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


SGLANG_CALLS = """
import json, torch
import sgl_kernel  # noqa: F401  (the stand-in: registers the fallbacks)
from sglang.kernels.ops.quantization import sgl_per_token_quant_fp8
from sglang.srt.hardware_backend.gpu.quantization import awq_kernels
from fineslab.quant.awq import pack_int4, quantize_linear
from fineslab.quant.fp8 import quantize_fp8_per_token
x = torch.randn(7, 64, dtype=torch.bfloat16)
q, s = torch.empty(7, 64, dtype=torch.float8_e4m3fn), torch.empty(7, 1)
sgl_per_token_quant_fp8(x, q, s)
ref_q, ref_s = quantize_fp8_per_token(x)
ql = quantize_linear(torch.randn(64, 128), 64)
w = awq_kernels.awq_dequantize(pack_int4(ql.values), ql.scales, pack_int4(ql.zeros))
print(json.dumps({"fp8": torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s),
                  "awq": torch.equal(w, ql.dequantize())}))
"""


@pytest.mark.slow
def test_sglang_reaches_the_fallbacks_through_the_stand_in(tmp_path: Path) -> None:
    """SGLang 0.5.23's own callers (the FP8 per-token quant wrapper that fp8_kernel imports on
    CUDA; awq_kernels' awq_dequantize) run our kernels once the stand-in is imported."""
    done = _run_with_stubs(tmp_path, SGLANG_CALLS, with_stand_in=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"fp8": True, "awq": True}


@pytest.mark.slow
def test_without_the_stand_in_sglang_has_no_kernel_for_them(tmp_path: Path) -> None:
    """The control: the same FP8 call without the stand-in reaches SGLang's JIT kernel, which
    has no CPU kernel here (and on CUDA needs nvcc at first use)."""
    script = SGLANG_CALLS.replace("import sgl_kernel", "pass  #")
    done = _run_with_stubs(tmp_path, script, with_stand_in=False)
    assert done.returncode != 0 and "per_token_quant_fp8" in done.stderr, done.stderr[-3000:]


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")  # the override itself
def test_an_op_defined_first_elsewhere_gets_our_kernels() -> None:
    """SGLang registered first (the stand-in imported late): `register` overrides its kernels
    through the dispatcher and says so."""
    namespace = f"fineslab_test_{uuid.uuid4().hex[:8]}"
    theirs = torch.library.Library(namespace, "FRAGMENT")
    for fallback in fallbacks.FALLBACKS:
        theirs.define(fallback.schema)
    theirs.impl("awq_dequantize", lambda qweight, scales, qzeros: scales.new_zeros(1), "CPU")
    theirs.impl("per_token_quant_fp8", lambda input, output_q, output_s: None, "CPU")
    assert set(fallbacks.register(namespace).values()) == {"overrode"}
    ops = getattr(torch.ops, namespace)
    ql, qweight, qzeros = _awq_layer()
    assert torch.equal(ops.awq_dequantize(qweight, ql.scales, qzeros), ql.dequantize())
    x = _activations(torch.bfloat16)
    q, scale = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.zeros(x.shape[0], 1)
    ops.per_token_quant_fp8(x, q, scale)
    assert per_token_violations(x, q, scale) == []

"""CPU mode's bf16 products (`sgl_kernel/gemm_cpu.py`): computed in fp32 and rounded once, by
the weight alone (alike for one row and many), torch's own kernel for other dtypes, for weights
over the limit and with FINESLAB_CPU_BF16_GEMM=torch.

Each check runs in a child of the CPU mode (as SGLang's processes do: importing `sgl_kernel`'s
stand-in registers the kernels), so that this process's torch is left as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from fineslab import cpu_mode

CHECKS = r"""
import json, os, torch
import torch.nn.functional as F
native_before = {}
torch.manual_seed(0)
x = torch.randn(64, 576).bfloat16()
w = torch.randn(1536, 576).bfloat16()        # F.linear's layout: the product takes w.t()
bias = torch.randn(1536).bfloat16()
row_major = torch.randn(576, 1536).bfloat16()  # AWQ's dequantized weight: x @ w
big = torch.randn(4200, 1024).bfloat16()        # over MAX_CONVERTED (4,194,304 values)
xb = torch.randn(8, 1024).bfloat16()
native = {"linear": F.linear(x, w), "biased": F.linear(x, w, bias), "row": x @ row_major,
          "big": F.linear(xb, big)}
import sgl_kernel
from sgl_kernel import gemm_cpu
registered = gemm_cpu.register_bf16_gemm()
fp32 = lambda a, b: (a.float() @ b.float()).bfloat16()
got = {"linear": F.linear(x, w), "biased": F.linear(x, w, bias), "row": x @ row_major,
       "big": F.linear(xb, big), "three_d": F.linear(x.view(4, 16, 576), w)}
alike = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    batch = F.linear(x, w, bias)
    alike += [torch.equal(torch.cat([F.linear(x[i:i + n], w, bias) for i in range(0, 64, n)]),
                          batch) for n in (1, 2, 3, 5, 6, 7, 16)]
f = torch.randn(16, 576) @ torch.randn(576, 32)
print(json.dumps({
    "registered": registered,
    "wanted": gemm_cpu.wanted(),
    "linear_is_fp32": bool(torch.equal(got["linear"], fp32(x, w.t()))),
    "biased_is_fp32": bool(torch.equal(got["biased"],
                                       (x.float() @ w.float().t() + bias.float()).bfloat16())),
    "row_major_is_fp32": bool(torch.equal(got["row"], fp32(x, row_major))),
    "three_d_is_fp32": bool(torch.equal(got["three_d"].view(64, 1536), fp32(x, w.t()))),
    "differs_from_torch": int((got["linear"] != native["linear"]).sum()),
    "rows_alike": alike,
    "big_is_torch": bool(torch.equal(got["big"], native["big"])),
    "dtype": str(got["linear"].dtype),
    "fp32_unchanged": f.dtype == torch.float32,
}))
"""


def _run(code: str, **env: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", code], env={**cpu_mode.child_environ(), **env},
                            capture_output=True, text=True, check=False, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    found = _run(CHECKS)
    if not found["wanted"]:
        pytest.skip("oneDNN runs bf16 on this CPU: the kernels are not registered")
    return found


def test_bf16_products_are_fp32_products_rounded_once(checks: dict[str, Any]) -> None:
    assert checks["registered"]
    assert checks["linear_is_fp32"] and checks["biased_is_fp32"] and checks["three_d_is_fp32"]
    assert checks["row_major_is_fp32"], "a row-major weight (AWQ's) is converted too"
    assert checks["dtype"] == "torch.bfloat16" and checks["fp32_unchanged"]
    # and the check can tell: torch's own bf16 loop sums in another order
    assert checks["differs_from_torch"] > 0


def test_one_row_computes_as_it_does_in_a_batch(checks: dict[str, Any]) -> None:
    """Products of 1, 2, 3, 5, 6, 7 and 16 rows on one thread and on two give each row what
    the product of all 64 does (MKL's fp32 kernels alone do not: the rows are padded)."""
    assert all(checks["rows_alike"]), checks["rows_alike"]


def test_a_weight_over_the_limit_keeps_torchs_kernel(checks: dict[str, Any]) -> None:
    assert checks["big_is_torch"]


def test_the_switch_keeps_torchs_kernels(checks: dict[str, Any]) -> None:
    off = _run(CHECKS, FINESLAB_CPU_BF16_GEMM="torch")
    assert off["registered"], "registered, and each call asks the switch"
    assert off["differs_from_torch"] == 0 and not off["linear_is_fp32"]

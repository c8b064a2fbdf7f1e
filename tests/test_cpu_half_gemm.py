"""CPU mode's bf16 and fp16 products (`sgl_kernel/gemm_cpu.py`): computed in fp32 and rounded
once, by the weight alone (alike for one row and many), torch's own kernel for other dtypes,
for weights over the limit and as FINESLAB_CPU_HALF_GEMM says.

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
import json, os, sys, torch
import torch.nn.functional as F
DT = getattr(torch, sys.argv[1])
torch.manual_seed(0)
x = torch.randn(64, 576).to(DT)
w = torch.randn(1536, 576).to(DT)        # F.linear's layout: the product takes w.t()
bias = torch.randn(1536).to(DT)
row_major = torch.randn(576, 1536).to(DT)  # AWQ's dequantized weight: x @ w
big = torch.randn(4200, 1024).to(DT)        # over MAX_CONVERTED (4,194,304 values)
xb = torch.randn(8, 1024).to(DT)
native = {"linear": F.linear(x, w), "biased": F.linear(x, w, bias), "row": x @ row_major,
          "big": F.linear(xb, big)}
import sgl_kernel
from sgl_kernel import gemm_cpu
registered = gemm_cpu.register_half_gemm()
fp32 = lambda a, b: (a.float() @ b.float()).to(DT)
got = {"linear": F.linear(x, w), "biased": F.linear(x, w, bias), "row": x @ row_major,
       "big": F.linear(xb, big), "three_d": F.linear(x.view(4, 16, 576), w)}
alike = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    batch = F.linear(x, w, bias)
    alike += [torch.equal(torch.cat([F.linear(x[i:i + n], w, bias) for i in range(0, 64, n)]),
                          batch) for n in (1, 2, 3, 5, 6, 7, 16)]
f = torch.randn(16, 576) @ torch.randn(576, 32)
nan_bias = torch.full((1536,), float("nan")).to(DT)
print(json.dumps({
    "registered": registered,
    "slow": DT in gemm_cpu.slow_dtypes(),
    "linear_is_fp32": bool(torch.equal(got["linear"], fp32(x, w.t()))),
    "biased_is_fp32": bool(torch.equal(got["biased"],
                                       (x.float() @ w.float().t() + bias.float()).to(DT))),
    "row_major_is_fp32": bool(torch.equal(got["row"], fp32(x, row_major))),
    "three_d_is_fp32": bool(torch.equal(got["three_d"].view(64, 1536), fp32(x, w.t()))),
    "differs_from_torch": int((got["linear"] != native["linear"]).sum()),
    "rows_alike": alike,
    "big_is_torch": bool(torch.equal(got["big"], native["big"])),
    "dtype": str(got["linear"].dtype),
    "fp32_unchanged": f.dtype == torch.float32,
    "beta0_ignores_bias": bool(torch.equal(torch.addmm(nan_bias, x, w.t(), beta=0),
                                           got["linear"])),
}))
"""


def _run(code: str, dtype: str, **env: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", code, dtype],
                            env={**cpu_mode.child_environ(), **env},
                            capture_output=True, text=True, check=False, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def checks(request: pytest.FixtureRequest) -> dict[str, Any]:
    found = _run(CHECKS, request.param, FINESLAB_CPU_HALF_GEMM="fp32")
    if not found["slow"]:
        pytest.skip(f"oneDNN runs {request.param} on this CPU: its products are left to it")
    found["dtype_asked"] = request.param
    return found


def test_bf16_products_are_fp32_products_rounded_once(checks: dict[str, Any]) -> None:
    assert checks["registered"]
    assert checks["linear_is_fp32"] and checks["biased_is_fp32"] and checks["three_d_is_fp32"]
    assert checks["row_major_is_fp32"], "a row-major weight (AWQ's) is converted too"
    assert checks["dtype"] == f"torch.{checks['dtype_asked']}" and checks["fp32_unchanged"]
    assert checks["beta0_ignores_bias"], "addmm with beta=0 ignores its bias, NaNs included"
    # and the check can tell: torch's own bf16 loop sums in another order
    assert checks["differs_from_torch"] > 0


def test_one_row_computes_as_it_does_in_a_batch(checks: dict[str, Any]) -> None:
    """Products of 1, 2, 3, 5, 6, 7 and 16 rows on one thread and on two give each row what
    the product of all 64 does (MKL's fp32 kernels alone do not: the rows are padded)."""
    assert all(checks["rows_alike"]), checks["rows_alike"]


def test_a_weight_over_the_limit_keeps_torchs_kernel(checks: dict[str, Any]) -> None:
    assert checks["big_is_torch"]


def test_the_switch_keeps_torchs_kernels(checks: dict[str, Any]) -> None:
    off = _run(CHECKS, checks["dtype_asked"], FINESLAB_CPU_HALF_GEMM="torch")
    assert off["registered"], "registered, and each call asks the switch"
    assert off["differs_from_torch"] == 0 and not off["linear_is_fp32"]
    bf16_only = _run(CHECKS, checks["dtype_asked"], FINESLAB_CPU_HALF_GEMM="bf16")
    assert bf16_only["linear_is_fp32"] == (checks["dtype_asked"] == "bfloat16")


def test_an_unknown_switch_value_is_named_and_the_default_taken() -> None:
    environ = {**cpu_mode.child_environ(), "FINESLAB_CPU_HALF_GEMM": "fp64"}
    result = subprocess.run([sys.executable, "-c", "from sgl_kernel import gemm_cpu; "
                             "print(sorted(str(d) for d in gemm_cpu._switched_on()))"],
                            env=environ, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FINESLAB_CPU_HALF_GEMM='fp64' is not one of fp32, bf16, torch" in result.stderr
    assert result.stdout.split("\n")[0] == "['torch.bfloat16', 'torch.float16']"


def test_the_default_converts_both() -> None:
    """bf16 and fp16, where oneDNN runs neither (gemm_cpu.DEFAULT_SWITCH)."""
    environ = {k: v for k, v in cpu_mode.child_environ().items() if k != "FINESLAB_CPU_HALF_GEMM"}
    result = subprocess.run([sys.executable, "-c", "from sgl_kernel import gemm_cpu; import torch; "
                             "print(sorted(str(d) for d in gemm_cpu._switched_on()))"],
                            env=environ, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[0] == "['torch.bfloat16', 'torch.float16']", result.stdout

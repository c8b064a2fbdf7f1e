"""The `precisions` stage's kernel checks (`fineslab.gpu_lite.stage_kernels`) on CPU: each passes
against its reference, and the FP8 and AWQ checks fail when the kernel SGLang reaches is wrong.

One fresh process (the Triton interpreter is set before triton is imported; the gpu-lite
`sgl_kernel` stand-in first on the path, as on the device) runs every check, then replaces the
two fallbacks' kernels with wrong ones and runs the FP8 and AWQ checks again. The served part
of the stage (runtime starts) is left to the CPU twin (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECKS = """
import json, torch
import sgl_kernel  # noqa: F401  (the stand-in: registers the fallbacks)
from fineslab.gpu_lite import stage_kernels as s
rows = {f.__name__: f("cpu") for f in (s.check_fp8_linear, s.check_awq_dequant,
                                       s.check_kv4_decode, s.check_kv4_backend,
                                       s.check_qoq_gemm)}
from fineslab.gpu_lite import fallbacks

def scales_doubled(input, output_q, output_s):
    fallbacks.per_token_quant_fp8(input, output_q, output_s)
    output_s.mul_(2)

def zero_points_off(qweight, scales, qzeros):
    return fallbacks.awq_dequantize(qweight, scales, qzeros + 0x11111111)

library = torch.library.Library("sglang", "IMPL")
library.impl("per_token_quant_fp8", scales_doubled, "CPU", allow_override=True)
library.impl("awq_dequantize", zero_points_off, "CPU", allow_override=True)
rows["wrong_fp8"] = s.check_fp8_linear("cpu")
rows["wrong_awq"] = s.check_awq_dequant("cpu")
print("ROWS", json.dumps(rows))
"""


@pytest.mark.slow
def test_kernel_checks_pass_and_catch_a_wrong_fallback(tmp_path: Path) -> None:
    stubs = tmp_path / "stubs"
    cpu_stubs = REPO / "fineslab" / "cpu_mode" / "stubs"
    shutil.copytree(REPO / "fineslab" / "gpu_lite" / "stubs" / "sgl_kernel", stubs / "sgl_kernel")
    shutil.copytree(cpu_stubs / "torchvision", stubs / "torchvision")  # SGLang's imports here
    shutil.copy2(cpu_stubs / "_fineslab_stubpkg.py", stubs)
    env = {**os.environ, "PYTHONPATH": f"{stubs}:{REPO}", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("ROWS "))
    rows = json.loads(line[5:])
    for name in ("check_fp8_linear", "check_awq_dequant", "check_kv4_decode", "check_kv4_backend",
                 "check_qoq_gemm"):
        assert rows[name]["ok"] is True, f"{name}: {rows[name]}"
    assert rows["check_fp8_linear"]["quant_equal"] and rows["check_awq_dequant"]["dequant_exact"]
    assert rows["wrong_fp8"]["ok"] is False, "doubled activation scales must fail the FP8 check"
    assert rows["wrong_awq"]["ok"] is False, "zero points off by one must fail the AWQ check"

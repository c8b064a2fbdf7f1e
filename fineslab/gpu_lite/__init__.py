"""gpu-lite: SGLang on the air-gapped GPU machine, in a carry of under 55 MiB (issue #36).

The GPU machine a session may borrow has no package registry, and at most 64 MiB travel with a
run; SGLang's own CUDA stack is over 400 MiB. Its image already holds Python 3.12, torch 2.11
with CUDA, triton and transformers. What SGLang needs beyond that is small:

    .gpu/                       built here by `bash scripts/gpu_bundle.sh` (this package's `bundle`)
      wheels/                   sglang 0.5.23, trimmed (`wheels.py`), and 36 small wheels
                                (requirements/gpu-lite.txt, their exact versions)
      stubs/                    fineslab's CUDA stand-in for `sgl_kernel` (`stubs/sgl_kernel`)
      models/                   the generated test models the checks serve (llama-tiny,
                                qwen2-tiny), exactly as on this machine
      manifest.json             every file with its bytes and sha256, what was trimmed and why

On the device, `scripts/gpu_check.sh` installs the wheels into `.gpu/site` when SGLang is not
importable, puts `.gpu/site` and `.gpu/stubs` on the path and runs its stages.
"""

"""How the staged device check's runtimes are started on each device (`check`, `stage_kernels`).

On CUDA the gpu-lite path: SGLang's triton attention backend, torch sampling, no CUDA graphs,
a small static memory share (a loan's H200 may hold other work), kernels that need no compiled
`sgl_kernel` (docs/gpu.md). The models are the generated ones the carry holds.
"""

from __future__ import annotations

from pathlib import Path

#: The gpu-lite path on CUDA: kernels that need no compiled sgl_kernel.
CUDA_ARGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch",
             "--disable-cuda-graph",
             "--mem-fraction-static", "0.15", "--max-total-tokens", "8192")


def model_dir(name: str) -> Path:
    """The generated model `name` (llama-tiny, qwen2-tiny) in fineslab's model cache."""
    from fineslab.env import FineslabEnv
    from fineslab.models.generate import ensure_model

    return ensure_model(name, FineslabEnv.from_environ().model_cache_dir)

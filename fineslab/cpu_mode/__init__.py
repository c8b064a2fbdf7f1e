"""CPU mode: what SGLang needs to run on a machine without a GPU, in one place.

SGLang 0.5.23 runs on CPU (torch_native attention, no CUDA graphs) once three things hold:

1. `SGLANG_USE_CPU_ENGINE=1` is in the environment of every SGLang process (without it the
   scheduler dies importing vllm);
2. a stand-in `sgl_kernel` is importable (the real wheel is CUDA-only and fails to import);
3. a stand-in `torchvision` is importable (the registry's wheels need CUDA torch).

The stand-ins live in `fineslab/cpu_mode/stubs/` and are activated only in CPU mode: fineslab puts
that folder first on `PYTHONPATH` of the SGLang processes it starts (`child_environ`), and the test
suite and in-process engines call `activate()`. On a GPU machine nothing here is used.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from fineslab.env import CPU_MODE_VAR, SGLANG_CPU_ENGINE_VAR, FineslabEnv

STUBS_DIR = Path(__file__).resolve().parent / "stubs"

#: Server arguments SGLang needs on CPU (`--device cpu` and friends), as `ServerArgs` fields.
#: `sleep_on_idle`: an idle scheduler waits on its sockets (woken at once by a request) instead
#: of spinning its event loop, which otherwise keeps one core busy per idle runtime.
CPU_SERVER_ARGS: dict[str, object] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "sleep_on_idle": True,
}


def cpu_server_argv() -> list[str]:
    """`CPU_SERVER_ARGS` as `sglang.launch_server` flags (a True field is a bare flag)."""
    argv: list[str] = []
    for name, value in CPU_SERVER_ARGS.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    return argv


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device (False when torch is CPU-only)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def is_cpu_mode(env: FineslabEnv | None = None) -> bool:
    """CPU mode is forced by FINESLAB_CPU_MODE, else on exactly when no CUDA device is visible."""
    env = env or FineslabEnv.from_environ()
    if env.cpu_mode is not None:
        return env.cpu_mode
    return not cuda_available()


def child_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an SGLang process started in CPU mode, from `base` (default: ours)."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH", "")
    entries = [p for p in path.split(os.pathsep) if p and p != str(STUBS_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS_DIR), *entries])
    env[SGLANG_CPU_ENGINE_VAR] = "1"
    env[CPU_MODE_VAR] = "1"
    return env


def activate() -> None:
    """Put CPU mode into effect in this process and the children it spawns.

    Needed when SGLang runs in-process (`sglang.Engine`): its scheduler and detokenizer processes
    inherit `sys.path` and the environment from here. Idempotent.
    """
    if str(STUBS_DIR) not in sys.path:
        sys.path.insert(0, str(STUBS_DIR))
    os.environ.update(child_environ())

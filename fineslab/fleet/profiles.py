"""Which profile the placer and the local scheduler use for each model on each device kind.

Lookup, first hit wins:

1. the model's `profile:` (a file path, or a profile name looked up as in 2);
2. `<preset or folder name>--<precision>--<device kind>.json` in the config's `profile_dirs`,
   then in the repository's `profiles/`; a measured profile beats an analytical one of the same
   name wherever each lies;
3. device kind "cpu" only: a *CPU estimate* computed from the model's config.json and weights
   (a roofline with CPU constants, below), logged as a warning that names the command making a
   measured one (`python -m fineslab.profile measure --model <preset>`). It exists so that the
   demo fleet runs right after set-up; its latencies are round numbers, not measurements;
4. otherwise a ConfigError naming the missing file and how to make it.

A profile of the right model and precision but another KV dtype (llama-tiny measured with BF16
KV, served with FP16 KV) is used with its `kv_token_bytes` recomputed for the served dtype.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.fleet.config import ModelConfig
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.devices import DeviceSpec
from fineslab.scheduler.kv_format import kv_token_bytes
from fineslab.scheduler.profile_schema import (
    DecodeTable,
    ModelProfile,
    Workload,
    load_profile,
    profile_name,
)
from fineslab.scheduler.roofline import PRECISIONS, Roofline

logger = logging.getLogger(__name__)

REPO_PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
#: Round numbers for one SGLang CPU runtime (torch_native attention, 2 cores): about 0.1 TFLOP/s
#: of GEMMs, 10 GB/s of memory traffic, and 25 ms of Python and scheduler work per step, which
#: dominates for the tiny generated models.
CPU_ESTIMATE = DeviceSpec("cpu", fp16_tflops=0.1, fp8_tflops=None, int8_tops=None,
                          hbm_bytes_per_s=10e9, memory_bytes=0)
CPU_STEP_OVERHEAD_S = 0.025
CPU_WORKLOAD = Workload(prompt_tokens=96, output_tokens=64)
CPU_CHUNK_TOKENS = 256
_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
_PREFILL_TOKENS = (16, 64, 256, 1024)
_CONTEXT_TOKENS = (64, 256, 1024)


def profile_dirs(configured: Sequence[str]) -> list[Path]:
    return [Path(d) for d in configured] + [REPO_PROFILES_DIR]


def _find_named(name: str, dirs: Sequence[Path]) -> ModelProfile | None:
    """The profile `name` in `dirs`: the first measured one, else the first analytical one."""
    found = [load_profile(d / f"{name}.json") for d in dirs if (d / f"{name}.json").is_file()]
    measured = [p for p in found if p.source == "measured"]
    ranked = measured or found
    return ranked[0] if ranked else None


def _with_kv_dtype(profile: ModelProfile, model: ModelConfig) -> ModelProfile:
    kv = model.kv.profile_name
    if profile.kv_dtype == kv:
        return profile
    s = profile.shape
    token_bytes = kv_token_bytes(s.num_layers, s.num_kv_heads, s.head_dim, kv, profile.tp)
    logger.info("profile %s has %s KV; %s serves %s KV: %d B a token", profile.name,
                profile.kv_dtype, model.name, kv, token_bytes)
    return dataclasses.replace(profile, kv_dtype=kv, kv_token_bytes=token_bytes)


def find_profile(model: ModelConfig, device_kind: str, dirs: Sequence[Path],
                 model_dir: Path | None) -> ModelProfile:
    """The profile of `model` on `device_kind` (see the module docstring for the order)."""
    if model.profile is not None:
        path = Path(model.profile).expanduser()
        explicit = load_profile(path) if path.suffix == ".json" and path.is_file() \
            else _find_named(model.profile, dirs)
        if explicit is None:
            raise ConfigError(f"model {model.name}: profile {model.profile!r} is neither a file "
                              f"nor a profile in {[str(d) for d in dirs]}")
        return _with_kv_dtype(explicit, model)
    name = profile_name(model.profile_model, model.precision, device_kind)
    profile = _find_named(name, dirs)
    if profile is not None:
        return _with_kv_dtype(profile, model)
    if device_kind == "cpu" and model_dir is not None:
        how = (f"python -m fineslab.profile measure --model {model.preset}" if model.preset
               else "python -m fineslab.profile measure")
        logger.warning("model %s: no profile %s.json; using a CPU estimate (make a measured "
                       "one with `%s`)", model.name, name, how)
        return cpu_estimate_profile(model, model_dir)
    raise ConfigError(
        f"model {model.name}: no profile {name}.json in {[str(d) for d in dirs]}. Make one with "
        f"`python -m fineslab.profile measure --model {model.profile_model}` on a {device_kind}, "
        "or `python -m fineslab.profile analytical` for the catalogued models, or name one with "
        "`profile:` in the fleet config")


def cpu_estimate_profile(model: ModelConfig, model_dir: Path) -> ModelProfile:
    """A roofline profile with CPU constants, from the model folder (no SGLang, milliseconds)."""
    from fineslab.models.checkpoint import read_shape, safetensors_bytes_and_params

    shape, _ = read_shape(model_dir)
    weights_bytes, num_params = safetensors_bytes_and_params(model_dir)
    shape = dataclasses.replace(shape, num_params=num_params)
    precision = dataclasses.replace(PRECISIONS["fp16"], kv_dtype=model.kv.profile_name)
    roof = Roofline(shape, precision, CPU_ESTIMATE, tp=1)

    def step_s(tokens: int, context: float, prefill: bool = False) -> float:
        return roof.step_s(tokens, context, prefill) + CPU_STEP_OVERHEAD_S

    ctx = CPU_WORKLOAD.mean_context_tokens
    throughput = [(b, b / step_s(b, ctx)) for b in _BATCH_SIZES]
    kv_per_request = ctx * roof.kv_token_bytes
    return ModelProfile(
        source="analytical", model=model.profile_model, precision=model.precision, device="cpu",
        tp=1, kv_dtype=precision.kv_dtype, shape=shape, weights_bytes=weights_bytes,
        kv_token_bytes=roof.kv_token_bytes, device_memory_bytes=1, chunk_tokens=CPU_CHUNK_TOKENS,
        workload=CPU_WORKLOAD,
        activation_bytes=PiecewiseLinear.from_points(
            [(b, roof.activation_bytes(b, CPU_CHUNK_TOKENS)) for b in _BATCH_SIZES]),
        prefill_s=PiecewiseLinear.from_points(
            [(n, step_s(n, n / 2, prefill=True)) for n in _PREFILL_TOKENS]),
        decode=DecodeTable(_BATCH_SIZES, _CONTEXT_TOKENS, tuple(
            tuple(step_s(b, c) for c in _CONTEXT_TOKENS) for b in _BATCH_SIZES)),
        throughput_tokens_per_s=PiecewiseLinear.from_points(throughput),
        mme=PiecewiseLinear.from_points([(0.0, 0.0)] + [
            (b * kv_per_request, tps) for b, tps in throughput]),
        provenance={"command": "fineslab.launch CPU estimate (no measured profile)",
                    "model_formula": "fineslab.scheduler.roofline with CPU constants"},
    )

"""FP8 W8A8KV8: an FP8 checkpoint writer and the per-layer FP8 KV scales (file, checks).

Glossary
    e4m3        float8_e4m3fn: 4 exponent bits, 3 mantissa bits, finite max 448
    weight_scale  one fp32 per projection: w ~= w_fp8 * weight_scale  (per-tensor)
    kv scale    one fp32 per layer, shared by K and V (SGLang's layout): stored = x / scale,
                read = stored * scale; chosen as amax(|K|, |V|) / 448 on calibration text

Checkpoint format (what SGLang's `fp8` method loads, `activation_scheme: dynamic`):
    <proj>.weight         [N, K] float8_e4m3fn
    <proj>.weight_scale   [] float32
    config.json: "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}
Activations are quantized per token at run time by SGLang; there is no input_scale.

KV scales file: SGLang's `--quantization-param-path` JSON (QuantParamSchema):
    {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn",
                                         "scaling_factor": {"0": {"0": s0, "1": s1, ...}}}}
SGLang swallows errors in that file and falls back to 1.0 with a log line; `load_kv_scales`
refuses a bad or incomplete file with ConfigError instead, and `kv_scales_or_warn` warns
loudly when a runtime is started with FP8 KV and no scales.

Invariants
    |w - w_fp8 * weight_scale| <= 2^-4 * |w| + weight_scale * 2^-9    (e4m3: 3 mantissa bits)
    every layer 0..L-1 has a finite kv scale > 0
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from fineslab.errors import ConfigError
from fineslab.quant.checkpoint import convert_checkpoint, is_quantized_linear

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
KV_SCALES_FILE = "kv_cache_scales.json"


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight in e4m3, fp32 scalar scale) with amax mapped to 448."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax() / E4M3_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, float32 scales [T, 1]): each row's amax mapped to 448, SGLang's dynamic
    per-token activation quant for W8A8 (`x ~= q * scale`, row by row). On x's device."""
    rows = x.to(torch.float32)
    scale = (rows.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (rows / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write an FP8 (W8A8, dynamic activations) copy of `src_dir`; other tensors in bf16."""

    def convert(hf_config: dict[str, object], tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not is_quantized_linear(name):
                out[name] = tensor.to(torch.bfloat16)
                continue
            out[name], out[f"{name}_scale"] = quantize_fp8_per_tensor(tensor)
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        return dict(hf_config, torch_dtype="bfloat16", quantization_config=qc), out

    return convert_checkpoint(Path(src_dir), Path(out_dir), convert)


def dequantize_fp8_checkpoint(fp8_dir: str | Path, out_dir: str | Path) -> Path:
    """The FP8 model with its weights dequantized to bf16: what CPU serving runs when SGLang's
    fp8 linear path is unavailable (docs/precisions.md)."""

    def convert(hf_config: dict[str, object], tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name.endswith(".weight_scale"):
                continue
            if tensor.dtype == torch.float8_e4m3fn:
                scale = tensors[f"{name}_scale"].to(torch.float32)
                out[name] = (tensor.to(torch.float32) * scale).to(torch.bfloat16)
            else:
                out[name] = tensor
        config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        return config, out

    return convert_checkpoint(Path(fp8_dir), Path(out_dir), convert)


def calibrate_kv_scales(model_dir: str | Path, token_ids: Sequence[Sequence[int]]
                        ) -> list[float]:
    """Per-layer kv scale = max(|K|, |V|) / 448 over `token_ids`, K after rotary embedding
    (what the cache stores), from a float32 transformers forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    amax: list[float] = []
    with torch.no_grad():
        for ids in token_ids:
            cache = model(torch.tensor([list(ids)]), use_cache=True).past_key_values
            for layer, (keys, values) in enumerate(_cache_layers(cache)):
                peak = float(torch.maximum(keys.abs().amax(), values.abs().amax()))
                if layer == len(amax):
                    amax.append(peak)
                amax[layer] = max(amax[layer], peak)
    return [max(a, 1e-6) / E4M3_MAX for a in amax]


def _cache_layers(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]  # type: ignore[attr-defined]


def write_kv_scales(path: str | Path, scales: Sequence[float], model_type: str) -> Path:
    """Write SGLang's `--quantization-param-path` file for TP size 1."""
    out = Path(path)
    body = {"model_type": model_type, "kv_cache": {
        "dtype": "float8_e4m3fn",
        "scaling_factor": {"0": {str(i): float(s) for i, s in enumerate(scales)}}}}
    out.write_text(json.dumps(body, indent=2) + "\n")
    return out


def load_kv_scales(path: str | Path, num_layers: int) -> tuple[float, ...]:
    """The per-layer scales of a kv scales file (TP rank 0); ConfigError if any is missing."""
    file = Path(path)
    try:
        body = json.loads(file.read_text())
        by_layer = body["kv_cache"]["scaling_factor"]["0"]
        dtype = body["kv_cache"].get("dtype")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"FP8 KV scales file {file}: unreadable ({type(exc).__name__}: {exc})"
                          ) from exc
    if dtype != "float8_e4m3fn":
        raise ConfigError(f"FP8 KV scales file {file}: dtype {dtype!r}, expected float8_e4m3fn")
    missing = [i for i in range(num_layers) if str(i) not in by_layer]
    if missing:
        raise ConfigError(f"FP8 KV scales file {file}: no scale for layer(s) {missing} of "
                          f"{num_layers}; SGLang would silently use 1.0 for all of them")
    scales = tuple(float(by_layer[str(i)]) for i in range(num_layers))
    bad = [i for i, s in enumerate(scales) if not (math.isfinite(s) and s > 0)]
    if bad:
        raise ConfigError(f"FP8 KV scales file {file}: layer(s) {bad} have a scale that is not "
                          "a finite positive number")
    return scales


def kv_scales_or_warn(path: str | Path | None, num_layers: int) -> tuple[float, ...]:
    """The scales to serve FP8 KV with: from `path`, or 1.0 everywhere with a warning."""
    if path is not None:
        return load_kv_scales(path, num_layers)
    logger.warning(
        "FP8 KV cache without scales: every layer's K/V scale defaults to 1.0, so values "
        "beyond +-448 saturate and small ones lose precision; calibrate with "
        "fineslab.quant.fp8.calibrate_kv_scales and pass the file as "
        "--quantization-param-path")
    return (1.0,) * num_layers

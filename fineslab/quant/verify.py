"""Checking a quantized checkpoint before a runtime loads it: a clear error instead of a crash.

SGLang loads what it is given: an AWQ `qweight` packed along the wrong dimension dies deep in a
weight loader with a shape assertion, and a missing `scales` tensor leaves the parameter
uninitialised (garbage output, no error). `verify_checkpoint` reads only the safetensors headers
and `config.json`, compares every quantized tensor with the shape the model's config implies,
and raises `ConfigError` listing every problem. Cost: a few milliseconds (no tensor data read).

Checked
    awq:   quantization_config (bits 4, group size divides K), for every projection of every
           layer: qweight [K, N/8] int32, qzeros [K/G, N/8] int32, scales [K/G, N] f16/bf16
    fp8:   every projection has an F8_E4M3 `.weight` and a `.weight_scale`; KV scales: see
           `fineslab.quant.fp8.load_kv_scales`
    fineslab_qoq (QoQ W4A8, fineslab.quant.qoq_checkpoint): bits 4, act_bits 8, for every
           projection: qweight [N, K/2] uint8, s2 [N, K/g] uint8, zeros [N, K/g] int8,
           s1 [N] f16, g the layer's group (`layer_group_size`)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.quant.checkpoint import LINEAR_SUFFIXES, read_config

#: safetensors dtype names of each tensor role
_INT32 = ("I32",)
_HALF = ("F16", "BF16")


#: bytes an element of each safetensors dtype takes
DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # on disk, from the header's data offsets

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


def read_headers(model_dir: Path) -> dict[str, TensorInfo]:
    """Name -> dtype and shape of every tensor, from the safetensors headers only."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"bad checkpoint {model_dir}: no *.safetensors file")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, meta in header.items():
            if name != "__metadata__":
                begin, end = meta["data_offsets"]
                infos[name] = TensorInfo(meta["dtype"], tuple(meta["shape"]), end - begin)
    return infos


def config_int(config: dict[str, object], key: str, default: int | None = None) -> int:
    """An integer field of config.json, or ConfigError naming it."""
    value = config.get(key, default)
    if not isinstance(value, int):
        raise ConfigError(f"bad checkpoint: config.json field {key!r} is {value!r}, not an int")
    return value


def projection_dims(config: dict[str, object]) -> dict[str, tuple[int, int]]:
    """(K, N) = (input, output) features of each projection suffix, from config.json."""
    hidden = config_int(config, "hidden_size")
    heads = config_int(config, "num_attention_heads")
    kv_heads = config_int(config, "num_key_value_heads", heads)
    head_dim = config_int(config, "head_dim", hidden // heads) if config.get("head_dim") \
        else hidden // heads
    inter = config_int(config, "intermediate_size")
    q, kv = heads * head_dim, kv_heads * head_dim
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}
    return {suffix: dims[suffix.rsplit(".", 1)[-1]] for suffix in LINEAR_SUFFIXES}


def _expect(problems: list[str], infos: dict[str, TensorInfo], name: str,
            dtypes: tuple[str, ...], shape: tuple[int, ...], what: str) -> None:
    info = infos.get(name)
    if info is None:
        problems.append(f"{name}: missing ({what})")
    elif info.dtype not in dtypes or info.shape != shape:
        problems.append(f"{name}: {info.dtype} {list(info.shape)}, expected "
                        f"{'/'.join(dtypes)} {list(shape)} ({what})")


def _awq_problems(config: dict[str, object], infos: dict[str, TensorInfo]) -> list[str]:
    qc = config["quantization_config"]
    assert isinstance(qc, dict)
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4 or not isinstance(group, int) or group <= 0:
        return [f"quantization_config: bits={bits} group_size={group}; AWQ serves 4 bits with "
                "a positive group size"]
    problems: list[str] = []
    num_layers = config_int(config, "num_hidden_layers")
    for layer in range(num_layers):
        for suffix, (k, n) in projection_dims(config).items():
            base = f"model.layers.{layer}.{suffix}"
            if k % group or n % 8:
                problems.append(f"{base}: K={k} is not a multiple of group {group} or N={n} of 8")
                continue
            _expect(problems, infos, f"{base}.qweight", _INT32, (k, n // 8),
                    "4-bit values packed 8 a word along the output dim, AWQ order")
            _expect(problems, infos, f"{base}.qzeros", _INT32, (k // group, n // 8),
                    "zeros packed like qweight")
            _expect(problems, infos, f"{base}.scales", _HALF, (k // group, n),
                    "one scale per group and output")
    return problems


def _fp8_problems(config: dict[str, object], infos: dict[str, TensorInfo]) -> list[str]:
    problems: list[str] = []
    num_layers = config_int(config, "num_hidden_layers")
    for layer in range(num_layers):
        for suffix, (k, n) in projection_dims(config).items():
            base = f"model.layers.{layer}.{suffix}"
            _expect(problems, infos, f"{base}.weight", ("F8_E4M3",), (n, k), "fp8 weight")
            info = infos.get(f"{base}.weight_scale")
            if info is None:
                problems.append(f"{base}.weight_scale: missing (per-tensor fp32 weight scale)")
    return problems


def _qoq_problems(config: dict[str, object], infos: dict[str, TensorInfo]) -> list[str]:
    from fineslab.quant.qoq_checkpoint import layer_group_size

    qc = config["quantization_config"]
    assert isinstance(qc, dict)
    group = qc.get("group_size")
    if qc.get("bits") != 4 or qc.get("act_bits") != 8 or not isinstance(group, int) \
            or group <= 0:
        return [f"quantization_config: bits={qc.get('bits')} act_bits={qc.get('act_bits')} "
                f"group_size={group}; QoQ serves 4-bit weights, 8-bit activations and a "
                "positive group size"]
    problems: list[str] = []
    for layer in range(config_int(config, "num_hidden_layers")):
        for suffix, (k, n) in projection_dims(config).items():
            base = f"model.layers.{layer}.{suffix}"
            try:
                g = layer_group_size(k, group)
            except ConfigError as exc:
                problems.append(f"{base}: {exc}")
                continue
            _expect(problems, infos, f"{base}.qweight", ("U8",), (n, k // 2),
                    "two 4-bit codes a byte")
            _expect(problems, infos, f"{base}.s2", ("U8",), (n, k // g), "level-2 group scales")
            _expect(problems, infos, f"{base}.zeros", ("I8",), (n, k // g), "group zero points")
            _expect(problems, infos, f"{base}.s1", ("F16",), (n,), "level-1 channel scales")
    return problems


def quant_method(config: dict[str, object]) -> str | None:
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or "quant_method" not in qc:
        raise ConfigError("bad checkpoint: quantization_config has no quant_method")
    return str(qc["quant_method"])


def verify_checkpoint(model_dir: str | Path) -> str | None:
    """Check the checkpoint in `model_dir`; return its quant method (None: unquantized).

    Raises ConfigError naming every tensor that is missing or mis-shaped.
    """
    path = Path(model_dir)
    config = read_config(path)
    method = quant_method(config)
    if method is None:
        return None
    checks = {"awq": _awq_problems, "fp8": _fp8_problems, "fineslab_qoq": _qoq_problems}
    if method not in checks:
        raise ConfigError(f"bad checkpoint {path}: quant_method {method!r} is not one fineslab "
                          f"serves (expected one of {sorted(checks)})")
    problems = checks[method](config, read_headers(path))
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        files = ", ".join(sorted(p.name for p in path.glob("*.safetensors")))
        raise ConfigError(f"bad {method} checkpoint {path} ({files}): {len(problems)} "
                          f"problem(s):\n  {shown}{more}")
    return method

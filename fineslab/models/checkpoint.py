"""What a model folder holds, read without loading a tensor: its shape and KV dtype from
`config.json`, its tensor bytes and parameter count from the safetensors headers. The
profiler's figures and the launcher's CPU estimate both start here."""

from __future__ import annotations

import json
from pathlib import Path

from fineslab.quant.verify import read_headers
from fineslab.scheduler.profile_schema import ModelShape
from fineslab.slabs.formats import KVDtype, KVShape


def read_shape(model_dir: Path) -> tuple[ModelShape, str]:
    """The model's shape and its KV dtype (the profiles' name of its torch dtype)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    kv = KVShape.from_hf_config(cfg, model_dir.name,
                                KVDtype.from_name(str(cfg.get("torch_dtype") or "bfloat16")))
    shape = ModelShape(kv.num_layers, cfg["hidden_size"], cfg["num_attention_heads"],
                       kv.num_kv_heads, kv.head_dim, cfg["intermediate_size"],
                       cfg["vocab_size"], 0)
    return shape, kv.kv_dtype.profile_name


def safetensors_bytes_and_params(model_dir: Path) -> tuple[int, int]:
    """Tensor bytes and element count from the safetensors headers (no tensor is loaded)."""
    infos = read_headers(model_dir).values()
    return sum(i.nbytes for i in infos), sum(i.num_elements for i in infos)

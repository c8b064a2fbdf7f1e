"""FP8 W8A8 checkpoints and FP8 KV scales: format, error bounds, clear errors, the 1.0 warning.

Bounds: e4m3 per-tensor weight error <= 2^-4 |w| + scale * 2^-9 per element (3 mantissa bits).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fineslab.errors import ConfigError
from fineslab.quant.fp8 import (
    calibrate_kv_scales,
    dequantize_fp8_checkpoint,
    kv_scales_or_warn,
    load_kv_scales,
    quantize_fp8_per_tensor,
    write_fp8_checkpoint,
    write_kv_scales,
)
from fineslab.quant.verify import verify_checkpoint


def test_per_tensor_fp8_error_bound() -> None:
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ()
    err = (q.float() * scale - w).abs()
    assert bool((err <= w.abs() * 2**-4 + scale * 2**-9).all())


@pytest.fixture(scope="module")
def fp8_dir(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_checkpoint(model_cache / "llama-tiny",
                                tmp_path_factory.mktemp("fp8") / "llama-tiny-fp8")


def test_fp8_checkpoint_verifies_and_dequantizes(fp8_dir: Path, tmp_path: Path) -> None:
    assert verify_checkpoint(fp8_dir) == "fp8"
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8",
                                             "activation_scheme": "dynamic"}
    deq = dequantize_fp8_checkpoint(fp8_dir, tmp_path / "deq")
    assert verify_checkpoint(deq) is None
    tensors = load_file(str(deq / "model.safetensors"))
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_missing_weight_scale_is_a_clear_error(fp8_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.2.self_attn.o_proj.weight_scale"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"o_proj\.weight_scale: missing"):
        verify_checkpoint(bad)


def test_kv_scales_roundtrip_and_cover_calibration(model_cache: Path, tmp_path: Path) -> None:
    ids = [list(range(3, 67))]
    scales = calibrate_kv_scales(model_cache / "llama-tiny", ids)
    assert len(scales) == 4 and all(s > 0 for s in scales)
    path = write_kv_scales(tmp_path / "scales.json", scales, "llama")
    assert load_kv_scales(path, 4) == pytest.approx(tuple(scales))


def test_missing_layer_scale_is_a_clear_error(tmp_path: Path) -> None:
    path = write_kv_scales(tmp_path / "scales.json", [0.1, 0.2, 0.3], "llama")
    with pytest.raises(ConfigError, match=r"no scale for layer\(s\) \[3\]"):
        load_kv_scales(path, 4)
    body = json.loads(path.read_text())
    body["kv_cache"]["scaling_factor"]["0"]["1"] = -1.0
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match="finite positive"):
        load_kv_scales(path, 3)
    with pytest.raises(ConfigError, match="unreadable"):
        load_kv_scales(tmp_path / "absent.json", 3)


def test_scales_defaulting_to_one_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fineslab.quant.fp8"):
        assert kv_scales_or_warn(None, 3) == (1.0, 1.0, 1.0)
    assert "default" in caplog.text and "1.0" in caplog.text

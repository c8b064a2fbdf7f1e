"""QoQ W4A8 checkpoints: exact round trip, the weight bytes, config, group fallback, errors.

Bounds: none needed. The writer is deterministic, so every layer must read back to exactly
the `QoQWeight` that `quantize_qoq` makes from the source weight, and every other tensor must
be byte-identical to the source's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fineslab.errors import ConfigError, IntegrityError
from fineslab.quant.checkpoint import is_quantized_linear, read_tensors
from fineslab.quant.qoq import QoQConfig, QoQWeight, quantize_qoq
from fineslab.quant.qoq_checkpoint import (
    layer_group_size,
    read_qoq_linear,
    write_qoq_checkpoint,
)


@pytest.fixture(scope="module")
def qoq_dir(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qoq_checkpoint(model_cache / "llama-tiny",
                                tmp_path_factory.mktemp("qoq") / "llama-tiny-qoq")


def _linear_layers(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name[: -len(".weight")] for name in tensors if is_quantized_linear(name)]


def _assert_same(got: QoQWeight, want: QoQWeight, layer: str) -> None:
    assert got.group_size == want.group_size, f"{layer}: group size must round-trip"
    for field in ("packed", "s2", "z", "s1"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{layer}.{field} must round-trip"


def _check_round_trip(src: Path, out: Path, group_size: int) -> dict[str, int]:
    """Assert the exact round trip of `out` against `src`; return each layer's group."""
    source, written = read_tensors(src), load_file(str(out / "model.safetensors"))
    layers = _linear_layers(source)
    groups = {}
    for layer in layers:
        weight = source[f"{layer}.weight"]
        g = layer_group_size(weight.shape[1], group_size)
        got = read_qoq_linear(written, layer)
        got.check_integrity()
        _assert_same(got, quantize_qoq(weight, QoQConfig(group_size=g)), layer)
        groups[layer] = g
    others = [name for name in source if not is_quantized_linear(name)]
    for name in others:
        a, b = written[name], source[name]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
            f"{name} is not a quantized linear and must be copied byte for byte")
    expected_names = set(others) | {f"{layer}.{s}" for layer in layers
                                    for s in ("qweight", "s2", "zeros", "s1")}
    assert set(written) == expected_names, "exactly the four tensors replace each weight"
    return groups


def test_every_layer_reads_back_exactly(model_cache: Path, qoq_dir: Path) -> None:
    groups = _check_round_trip(model_cache / "llama-tiny", qoq_dir, 128)
    assert len(groups) == 4 * 7 and set(groups.values()) == {128}


def test_linear_weight_bytes_are_a_quarter_of_bf16(model_cache: Path, qoq_dir: Path) -> None:
    source, written = read_tensors(model_cache / "llama-tiny"), load_file(
        str(qoq_dir / "model.safetensors"))
    qoq_bytes = bf16_bytes = formula_bytes = 0
    for layer in _linear_layers(source):
        n, k = source[f"{layer}.weight"].shape
        g = 128
        qoq_bytes += sum(t.numel() * t.element_size() for name, t in written.items()
                         if name.rpartition(".")[0] == layer)
        bf16_bytes += 2 * n * k
        # qoq.py: weight bytes / bf16 bytes = 1/4 + 1/G + bytes(s1) / (2K), fp16 s1.
        formula_bytes += round(2 * n * k * (1 / 4 + 1 / g + 2 / (2 * k)))
    assert qoq_bytes == formula_bytes, "bytes must follow qoq.py's formula exactly"
    ratio = qoq_bytes / bf16_bytes
    assert 0.25 < ratio < 0.27, f"W4 with G = 128 should be about a quarter of bf16, got {ratio}"


def test_config_declares_fineslab_qoq(model_cache: Path, qoq_dir: Path) -> None:
    config = json.loads((qoq_dir / "config.json").read_text())
    source = json.loads((model_cache / "llama-tiny" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fineslab_qoq", "bits": 4, "act_bits": 8, "group_size": 128,
        "s1_dtype": "float16", "protective_range": 119}
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source, (
        "nothing else in config.json changes")


def test_group_falls_back_to_a_power_of_two_dividing_k() -> None:
    assert layer_group_size(512, 128) == 128
    assert layer_group_size(576, 128) == 64, "SmolLM2's hidden size 576 takes group 64"
    assert layer_group_size(640, 256) == 128
    assert layer_group_size(256, 96) == 64, "a G that does not divide K falls to a power of two"
    assert layer_group_size(6, 128) == 2
    with pytest.raises(ConfigError, match="odd"):
        layer_group_size(7, 128)


def test_writer_uses_the_fallback_group(model_cache: Path, tmp_path: Path) -> None:
    # qwen2-tiny: hidden 256, intermediate 640; G = 256 does not divide down_proj's K = 640.
    src = model_cache / "qwen2-tiny"
    out = write_qoq_checkpoint(src, tmp_path / "qwen2-qoq", group_size=256)
    groups = _check_round_trip(src, out, 256)
    assert groups["model.layers.0.mlp.down_proj"] == 128
    assert groups["model.layers.0.self_attn.q_proj"] == 256
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 256, "the config keeps the asked-for G; layers derive theirs"


def test_bad_source_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        write_qoq_checkpoint(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        write_qoq_checkpoint(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a failed writer leaves no output behind"
    with pytest.raises(ConfigError, match="group_size"):
        write_qoq_checkpoint(tmp_path / "empty", tmp_path / "out", group_size=3)


def test_missing_tensor_is_a_clear_error(qoq_dir: Path) -> None:
    tensors = load_file(str(qoq_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.s2"]
    with pytest.raises(ConfigError, match=r"up_proj\.s2: missing"):
        read_qoq_linear(tensors, "model.layers.1.mlp.up_proj")


def test_corrupted_packed_codes_are_caught(model_cache: Path, qoq_dir: Path,
                                           tmp_path: Path) -> None:
    """Negative control: the round-trip check must notice a changed code."""
    bad = tmp_path / "bad"
    shutil.copytree(qoq_dir, bad)
    layer = "model.layers.2.self_attn.o_proj"
    tensors = load_file(str(bad / "model.safetensors"))
    weight = read_qoq_linear(tensors, layer)
    # Code 15 in a group with s2 = 16 and z = -7 dequantizes to (15 + 7) * 16 = 352: not INT8.
    s2, z = weight.s2.clone(), weight.z.clone()
    s2[0, 0], z[0, 0] = 16, -7
    tensors[f"{layer}.s2"], tensors[f"{layer}.zeros"] = s2, z
    packed = tensors[f"{layer}.qweight"].clone()
    packed[0, 0] = 0xFF
    tensors[f"{layer}.qweight"] = packed
    with pytest.raises(IntegrityError):
        read_qoq_linear(tensors, layer).check_integrity()
    # A single flipped bit keeps every invariant, so only the comparison catches it.
    tensors = load_file(str(qoq_dir / "model.safetensors"))
    packed = tensors[f"{layer}.qweight"].clone()
    packed[3, 5] ^= 0x01
    tensors[f"{layer}.qweight"] = packed
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(AssertionError, match=r"o_proj\.packed must round-trip"):
        _check_round_trip(model_cache / "llama-tiny", bad, 128)

"""AWQ checkpoint format: packing, the CPU stand-in op, the writer, and bad-checkpoint errors.

Bounds: packing and the stand-in op are exact (bit-for-bit equal to the reference dequant);
round-to-nearest error per weight <= scale / 2 (+ fp16 rounding of the scale, 1e-3 relative).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fineslab.cpu_mode import STUBS_DIR
from fineslab.errors import ConfigError
from fineslab.quant.awq import (
    AWQConfig,
    pack_int4,
    quantize_linear,
    unpack_int4,
    write_awq_checkpoint,
)
from fineslab.quant.verify import verify_checkpoint


def _stub_op():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(STUBS_DIR)) if str(STUBS_DIR) not in sys.path else None
    from sgl_kernel.awq_cpu import awq_dequantize

    return awq_dequantize


def test_pack_order_is_awqs_interleaved_order() -> None:
    values = torch.arange(8, dtype=torch.int32).reshape(1, 8)  # column c holds value c
    word = int(pack_int4(values)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7], "nibble i must hold column (0 2 4 6 1 3 5 7)[i]"


def test_pack_unpack_roundtrip_all_codes() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (64, 128), generator=gen, dtype=torch.int32)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


def test_stand_in_awq_dequantize_matches_reference_exactly() -> None:
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))  # HF [N, K]
    ql = quantize_linear(weight, group_size=32)
    got = _stub_op()(pack_int4(ql.values), ql.scales, pack_int4(ql.zeros))
    assert got.dtype == torch.float16 and got.shape == (128, 96)
    assert torch.equal(got, ql.dequantize()), "the CPU op must reproduce AWQ's dequant exactly"


def test_a_dequantized_weight_is_not_changed_by_the_next_dequantization() -> None:
    """The unpacked values live in a buffer each thread reuses: the weights it returns are
    the caller's, whatever is dequantized after them (larger or smaller)."""
    gen = torch.Generator().manual_seed(3)
    layers = [quantize_linear(torch.randn(n, k, generator=gen), group_size=32)
              for n, k in ((96, 128), (192, 256), (64, 64))]
    first = _stub_op()(pack_int4(layers[0].values), layers[0].scales, pack_int4(layers[0].zeros))
    kept = first.clone()
    for ql in layers[1:]:
        got = _stub_op()(pack_int4(ql.values), ql.scales, pack_int4(ql.zeros))
        assert torch.equal(got, ql.dequantize())
    assert torch.equal(first, kept)


def test_round_to_nearest_error_is_half_a_step() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    ql = quantize_linear(weight, group_size=64)
    step = ql.scales.float().repeat_interleave(64, dim=0)
    err = (ql.dequantize().float() - weight.t()).abs()
    assert bool((err <= step / 2 * 1.001 + 1e-3).all()), "RTN error must stay within half a step"


def test_sglang_custom_op_has_the_cpu_kernel() -> None:
    _stub_op()
    import sgl_kernel  # noqa: F401  (registers the CPU kernel)

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    ql = quantize_linear(weight, group_size=64)
    from sglang.srt.hardware_backend.gpu.quantization import awq_kernels

    got = awq_kernels.awq_dequantize(pack_int4(ql.values), ql.scales, pack_int4(ql.zeros))
    assert torch.equal(got, ql.dequantize()), "SGLang's awq_dequantize op must run on CPU"


@pytest.fixture(scope="module")
def awq_dir(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("awq") / "llama-tiny-awq"
    return write_awq_checkpoint(model_cache / "llama-tiny", out, AWQConfig(group_size=64))


def test_writer_output_verifies_and_declares_awq(awq_dir: Path) -> None:
    assert verify_checkpoint(awq_dir) == "awq"
    qc = json.loads((awq_dir / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                  "version": "gemm"}


def _corrupt(awq_dir: Path, out: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    import shutil

    shutil.copytree(awq_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_wrong_packing_is_a_clear_error(awq_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.down_proj.qweight"

    def pack_along_input(t: dict[str, torch.Tensor]) -> None:
        k, n8 = t[name].shape  # GPTQ-style packing along K: [K / 8, N]
        t[name] = torch.zeros(k // 8, n8 * 8, dtype=torch.int32)

    bad = _corrupt(awq_dir, tmp_path / "bad", pack_along_input)
    with pytest.raises(ConfigError, match=r"down_proj\.qweight.*expected I32 \[512, 32\]"):
        verify_checkpoint(bad)


def test_missing_scales_is_a_clear_error(awq_dir: Path, tmp_path: Path) -> None:
    bad = _corrupt(awq_dir, tmp_path / "bad",
                   lambda t: t.pop("model.layers.0.self_attn.k_proj.scales"))
    with pytest.raises(ConfigError, match=r"k_proj\.scales: missing"):
        verify_checkpoint(bad)


def test_header_reading_counts_each_dtype_by_its_width(tmp_path: Path) -> None:
    """The profile's weight bytes and parameter count come from the safetensors headers alone
    (one table of dtype widths, `quant.verify.DTYPE_BYTES`, shared with Select-N's sizing):
    an int16 or float64 tensor is counted by its elements, not its bytes."""
    from fineslab.models.checkpoint import safetensors_bytes_and_params

    tensors = {"a": torch.zeros(3, 5, dtype=torch.float64),
               "b": torch.zeros(7, dtype=torch.int16),
               "c": torch.zeros(2, 4, dtype=torch.bfloat16),
               "d": torch.zeros(6, dtype=torch.uint8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert safetensors_bytes_and_params(tmp_path) == (15 * 8 + 7 * 2 + 8 * 2 + 6, 15 + 7 + 8 + 6)

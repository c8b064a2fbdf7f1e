"""AWQ W4A16 checkpoints: the format SGLang's `awq` method loads, a writer, and a checker.

Glossary
    K, N        a linear layer's input and output features (HF weight is [N, K]; AWQ stores the
                transpose, [K, N], so that the layer computes x @ W)
    G           group size: K is cut into K / G groups sharing one scale and zero per column
    q           a 4-bit unsigned value 0..15;  w = (q - zero) * scale

Format (AutoAWQ "gemm" version, what `AWQLinearScheme.create_weights` allocates):

    <layer>.qweight  [K, N / 8]      int32   8 values a word, AWQ's interleaved order
    <layer>.qzeros   [K / G, N / 8]  int32   zeros, packed the same way
    <layer>.scales   [K / G, N]      float16
    word j of a row:  bits 4i..4i+3 = column 8j + PACK_ORDER[i],  PACK_ORDER = 0 2 4 6 1 3 5 7
    config.json: "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": G,
                                         "zero_point": true, "version": "gemm"}

Invariants
    K % G == 0,  N % 8 == 0,  0 <= q, zero <= 15
    dequantize(pack(q), scales, pack(zero)) == (q - zero) * scales    exactly, in float16

The writer quantizes with round-to-nearest per group (min/max, asymmetric), without AWQ's
activation-aware scale search: that search needs calibration data and changes accuracy, not the
format, and the format is what serving depends on. So no AutoAWQ or llm-compressor is needed.
Embeddings, norms and `lm_head` stay in float16, as in AutoAWQ's output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from fineslab.cpu_mode.scratch import scratch
from fineslab.errors import ConfigError
from fineslab.quant.checkpoint import convert_checkpoint, is_quantized_linear

logger = logging.getLogger(__name__)

PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
VALUES_PER_WORD = 8
MAX_Q = 15


@dataclass(frozen=True)
class AWQConfig:
    """How to quantize: group size along the input dimension (AWQ's usual 128; 64 fits
    SmolLM2's hidden size 576)."""

    group_size: int = 64

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.group_size % VALUES_PER_WORD:
            raise ConfigError(f"AWQ group_size {self.group_size}: must be a positive multiple "
                              "of 8")

    def quantization_config(self) -> dict[str, object]:
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                "zero_point": True, "version": "gemm"}


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, 8 C] int values 0..15 -> [R, C] int32 words in AWQ's interleaved order."""
    rows, cols = values.shape
    if cols % VALUES_PER_WORD:
        raise ConfigError(f"AWQ packing needs a multiple of 8 columns, got {cols}")
    groups = values.to(torch.int64).reshape(rows, cols // VALUES_PER_WORD, VALUES_PER_WORD)
    words = torch.zeros(rows, cols // VALUES_PER_WORD, dtype=torch.int64)
    for nibble, column in enumerate(PACK_ORDER):
        words |= groups[:, :, column] << (4 * nibble)
    # Reinterpret as signed 32-bit: the top nibble may set the sign bit.
    return words.to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: [R, C] int32 -> [R, 8 C] int32 values 0..15."""
    rows, cols = words.shape
    out = torch.empty(rows, cols, VALUES_PER_WORD, dtype=torch.int32)
    for nibble, column in enumerate(PACK_ORDER):
        out[:, :, column] = (words >> (4 * nibble)) & 0xF
    return out.reshape(rows, cols * VALUES_PER_WORD)


def _values_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """Room for the unpacked int32 values: on CPU this thread's scratch, reused by the next
    dequantization (`fineslab.cpu_mode.scratch`)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.int32, device=device)
    return scratch(numel, torch.int32)


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor,
                      qzeros: torch.Tensor) -> torch.Tensor:
    """The [K, N] weight in `scales.dtype`, on their device, from AWQ's packed tensors
    (qweight [K, N/8], qzeros [K/G, N/8] int32; scales [K/G, N]): `w = (q - zero) * scale`.

    What SGLang's `awq_dequantize` computes. One [K, N] result; the unpacked values go to a
    buffer this thread keeps on CPU (on 576 x 1536 values, one thread: 2.6-3.3 ms a call with
    fresh temporaries, about half with it). Groups are broadcast, not repeated to [K, N].
    """
    shifts = torch.tensor([4 * PACK_ORDER.index(c) for c in range(VALUES_PER_WORD)],
                          dtype=torch.int32, device=qweight.device)
    in_features, groups = qweight.shape[0], scales.shape[0]
    values = _values_buffer(qweight.numel() * VALUES_PER_WORD, qweight.device).view(
        *qweight.shape, VALUES_PER_WORD)
    torch.bitwise_right_shift(qweight.unsqueeze(-1), shifts, out=values)
    values = values.bitwise_and_(0xF).view(groups, in_features // groups, -1)
    zeros = ((qzeros.unsqueeze(-1) >> shifts) & 0xF).reshape(groups, 1, -1)
    weight = values.sub_(zeros).to(scales.dtype, copy=True)  # never the buffer itself
    return weight.mul_(scales.view(groups, 1, -1)).view(in_features, -1)


@dataclass(frozen=True)
class QuantizedLinear:
    """One layer's AWQ tensors, unpacked: values [K, N], zeros and scales [K / G, N]."""

    values: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The [K, N] float16 weight the AWQ kernel reconstructs."""
        group = self.values.shape[0] // self.scales.shape[0]
        zeros = self.zeros.repeat_interleave(group, dim=0)
        scales = self.scales.repeat_interleave(group, dim=0)
        return (self.values - zeros).to(torch.float16) * scales


def quantize_linear(weight: torch.Tensor, group_size: int) -> QuantizedLinear:
    """Round-to-nearest asymmetric 4-bit quantization of an HF [N, K] weight, per group of K."""
    w = weight.to(torch.float32).t()  # [K, N]
    in_features, out_features = w.shape
    if in_features % group_size or out_features % VALUES_PER_WORD:
        raise ConfigError(f"AWQ: a [{out_features}, {in_features}] weight does not fit group "
                          f"size {group_size} (K % G) and 8-column packing (N % 8)")
    grouped = w.reshape(in_features // group_size, group_size, out_features)
    w_min = grouped.amin(dim=1).clamp(max=0.0)
    w_max = grouped.amax(dim=1).clamp(min=0.0)
    scales = ((w_max - w_min) / MAX_Q).clamp(min=1e-5).to(torch.float16)
    scales_f = scales.to(torch.float32)
    zeros = torch.round(-w_min / scales_f).clamp(0, MAX_Q)
    q = torch.round(grouped / scales_f[:, None, :]) + zeros[:, None, :]
    values = q.clamp(0, MAX_Q).reshape(in_features, out_features).to(torch.int32)
    return QuantizedLinear(values, zeros.to(torch.int32), scales)


def write_awq_checkpoint(src_dir: str | Path, out_dir: str | Path,
                         config: AWQConfig | None = None) -> Path:
    """Write an AWQ W4A16 copy of the model in `src_dir` to `out_dir` (float16 elsewhere)."""
    cfg = config or AWQConfig()

    def convert(hf_config: dict[str, object], tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not is_quantized_linear(name):
                out[name] = tensor.to(torch.float16)
                continue
            layer = name[: -len(".weight")]
            ql = quantize_linear(tensor, cfg.group_size)
            out[f"{layer}.qweight"] = pack_int4(ql.values)
            out[f"{layer}.qzeros"] = pack_int4(ql.zeros)
            out[f"{layer}.scales"] = ql.scales
        new_config = dict(hf_config, torch_dtype="float16",
                          quantization_config=cfg.quantization_config())
        return new_config, out

    return convert_checkpoint(Path(src_dir), Path(out_dir), convert)


def write_dequantized_reference(awq_dir: str | Path, out_dir: str | Path) -> Path:
    """The AWQ model in `awq_dir` with every layer dequantized to a float16 `.weight`: the
    reference the served AWQ model must match (same numbers, no quantization at serve time)."""

    def convert(hf_config: dict[str, object], tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name.endswith((".qzeros", ".scales")):
                continue
            if name.endswith(".qweight"):
                layer = name[: -len(".qweight")]
                out[f"{layer}.weight"] = dequantize_layer(tensors, layer).t().contiguous()
            else:
                out[name] = tensor
        new_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        return new_config, out

    return convert_checkpoint(Path(awq_dir), Path(out_dir), convert)


def dequantize_layer(tensors: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """The [K, N] float16 weight of AWQ layer `layer` from the checkpoint's tensors."""
    ql = QuantizedLinear(unpack_int4(tensors[f"{layer}.qweight"]),
                         unpack_int4(tensors[f"{layer}.qzeros"]), tensors[f"{layer}.scales"])
    return ql.dequantize()

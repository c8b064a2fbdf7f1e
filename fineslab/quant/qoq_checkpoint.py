"""QoQ W4A8 checkpoints: a writer from a BF16 model directory and a reader of one layer.

Every linear layer that `checkpoint.is_quantized_linear` picks (the q/k/v/o and gate/up/down
projections of each decoder layer, as for AWQ) is replaced by its `QoQWeight` (`qoq.py`: the
layout, the invariants and the math). Everything else, embeddings, norms and `lm_head`
included, is copied byte for byte in its source dtype (QServe keeps them 16-bit too).

Format of one layer `<layer>` (e.g. `model.layers.0.self_attn.q_proj`), weight [N, K], group g:

    <layer>.qweight  [N, K / 2]  uint8    two 4-bit codes q a byte, low nibble = even k
    <layer>.s2       [N, K / g]  uint8    level-2 scale of each group, 1..16
    <layer>.zeros    [N, K / g]  int8     level-2 zero point z of each group
    <layer>.s1       [N]         float16  level-1 scale of each output channel
    W_hat[n, k] = (q[n, k] - z[n, k // g]) * s2[n, k // g] * s1[n]

    config.json: "quantization_config": {"quant_method": "fineslab_qoq", "bits": 4,
        "act_bits": 8, "group_size": G, "s1_dtype": "float16", "protective_range": 119}

Every tensor keeps the output channel n as its row, so SGLang's loaders shard fused layers
(qkv_proj, gate_up_proj) along rows with no repacking.

Group size of a layer. G (default 128, QServe's) is what the config asks for; a layer uses
    g = G                                        when G divides K,
    g = the largest power of two <= G dividing K  otherwise (SmolLM2's K = 576: g = 64),
and the writer fails with ConfigError when that g would be 1 (K odd: no whole bytes). The
reader recovers g from the shapes (K / s2.shape[1]); `layer_group_size` is the one rule, used
by the writer and by the SGLang method to size its tensors.

Cost: weight bytes / bf16 bytes of a layer = 1/4 + 1/g + 1/K (float16 s1), as in `qoq.py`.

What QServe does that this leaves out. This is QoQ's storage format and numerics with plain
round-to-nearest quantization of the BF16 weights, and nothing else: no SmoothAttention (the
key scaling that makes KV4 keys easier to quantize), no rotation of the residual stream or of
the down_proj inputs (Hadamard), no activation-aware channel scaling or smoothing of the
linear inputs, and no weight clipping search. Those need calibration data and change accuracy,
not the format; a model written here is less accurate than QServe's at the same bits.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fineslab.errors import ConfigError
from fineslab.precisions import QOQ_METHOD
from fineslab.quant.checkpoint import convert_checkpoint, is_quantized_linear
from fineslab.quant.qoq import PROTECTIVE_RANGE, QoQConfig, QoQWeight, quantize_qoq

logger = logging.getLogger(__name__)

#: The checkpoint's quant_method (the registry's name for it).
QUANT_METHOD = QOQ_METHOD
#: The four tensors of one quantized layer, by suffix, and the `QoQWeight` field each holds.
TENSOR_FIELDS = {"qweight": "packed", "s2": "s2", "zeros": "z", "s1": "s1"}


def layer_group_size(in_features: int, group_size: int) -> int:
    """The group a layer with K = `in_features` uses under the configured G (module docstring).

    Raises ConfigError when no even group divides K."""
    if in_features % group_size == 0:
        return group_size
    g = 1 << (group_size.bit_length() - 1)
    while g > 1 and in_features % g:
        g //= 2
    if g < 2:
        raise ConfigError(f"QoQ: in_features {in_features} is odd: no even group divides it "
                          "(two 4-bit codes a byte)")
    return g


def quantization_config(group_size: int) -> dict[str, object]:
    """The `quantization_config` block of a QoQ checkpoint's config.json."""
    return {"quant_method": QUANT_METHOD, "bits": 4, "act_bits": 8, "group_size": group_size,
            "s1_dtype": "float16", "protective_range": PROTECTIVE_RANGE}


def qoq_tensors(layer: str, weight: QoQWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one layer, by full name."""
    return {f"{layer}.{suffix}": getattr(weight, field)
            for suffix, field in TENSOR_FIELDS.items()}


def read_qoq_linear(tensors: dict[str, torch.Tensor], layer: str) -> QoQWeight:
    """The `QoQWeight` of `layer` from a QoQ checkpoint's tensors; the group from the shapes.

    Raises ConfigError naming a missing tensor or shapes that do not fit together."""
    found: dict[str, torch.Tensor] = {}
    for suffix, field in TENSOR_FIELDS.items():
        name = f"{layer}.{suffix}"
        if name not in tensors:
            raise ConfigError(f"QoQ checkpoint: {name}: missing")
        found[field] = tensors[name]
    in_features, groups = 2 * found["packed"].shape[-1], found["s2"].shape[-1]
    if groups == 0 or in_features % groups:
        raise ConfigError(f"QoQ checkpoint: {layer}: {groups} groups do not divide K = "
                          f"{in_features}")
    return QoQWeight(group_size=in_features // groups, **found)


def write_qoq_checkpoint(src_dir: str | Path, out_dir: str | Path,
                         group_size: int = 128) -> Path:
    """Write a QoQ W4A8 copy of the model in `src_dir` to `out_dir` (format: module docstring).

    Raises ConfigError for a source directory without config.json or safetensors, a bad group
    size, or a layer no even group fits."""
    QoQConfig(group_size=group_size)  # validates G before any tensor is read

    def convert(hf_config: dict[str, object], tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not is_quantized_linear(name):
                out[name] = tensor
                continue
            g = layer_group_size(tensor.shape[-1], group_size)
            if g != group_size:
                logger.info("QoQ: %s has K = %d: group %d instead of %d", name,
                            tensor.shape[-1], g, group_size)
            weight = quantize_qoq(tensor, QoQConfig(group_size=g))
            out.update(qoq_tensors(name[: -len(".weight")], weight))
        return dict(hf_config, quantization_config=quantization_config(group_size)), out

    return convert_checkpoint(Path(src_dir), Path(out_dir), convert)

"""QoQ W4A8 linear layers in SGLang: the `fineslab_qoq` quantization method the plugin registers.

SGLang 0.5.23 has no dense W4A8 method, and no registration function: `get_quantization_config`
(`sglang/srt/layers/quantization/__init__.py`) looks the name up in the module-level dict
`QUANTIZATION_METHODS` (and, on a CPU with AMX, in `CPU_QUANTIZATION_METHODS`), and
`ModelConfig._verify_quantization` accepts a name that the same dict object holds. So
`register_qoq_method()` adds `fineslab_qoq` to those dicts (checking first that they are the
dicts SGLang reads) and to the `--quantization` choices (SGLang's own
`add_quantization_method_choices`), in each SGLang process that needs it (`install.wants_qoq`:
its `--model-path` is a QoQ checkpoint, or FINESLAB_QOQ=1 for an in-process engine). A
checkpoint written by `fineslab.quant.qoq_checkpoint` declares `quant_method: fineslab_qoq` in
config.json, and SGLang picks the method from that alone (what the engine test runs);
`--quantization fineslab_qoq` names it explicitly (the CLI parses it; not served in a test).

Per linear layer (fused qkv_proj / gate_up_proj included), weight [N, K], group g:

    qweight [N, K / 2] uint8, s2 [N, K / g] uint8, zeros [N, K / g] int8, s1 [N] float16

every tensor with the output channel as row 0, so SGLang's own loaders (`output_dim=0`, and
`input_dim=1` for row-parallel sharding of K) stack the q/k/v and gate/up shards into rows.

After loading, a layer on CUDA (with triton importable and a power-of-two group) keeps only its
packed tensors: `apply` is `qoq_triton.w4a8_linear_triton`, a Triton W4A8 GEMM that unpacks
the nibbles and applies level 2 in the kernel (INT8 x INT8 tiles, INT32 accumulation). It is
exact against the torch path under the Triton interpreter; no GPU has run it yet (timings:
`tests/precisions/test_qoq_triton.py`, gpu-marked). Anywhere else the layer also caches the
INT8 level-2 dequantization v_hat [N, K] (`qoq_weight_int8`, a non-persistent buffer) and s1
in float32: that costs N K bytes more (the whole linear weight then takes 0.26 + 0.5 of its
bf16 bytes) and saves unpacking on every call. `apply` is then `qoq.w4a8_linear` with that
cache: per-token INT8 activations, an exact INT32 product (`qoq.int8_matmul`), scales
s_x[t] * s1[n] in float32, bias. That is a CPU reference path, not a serving kernel.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs

from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.quant.checkpoint import LINEAR_SUFFIXES
from fineslab.quant.qoq import (
    QoQWeight,
    dequantize_qoq_to_int8,
    int8_matmul,
    quantize_activations_int8,
)
from fineslab.quant.qoq_checkpoint import QUANT_METHOD, layer_group_size

logger = logging.getLogger(__name__)

#: The last name of every SGLang linear layer whose checkpoint weights the writer quantized:
#: the writer's projections and SGLang's fusions of them.
QUANTIZED_LINEARS = frozenset({s.rpartition(".")[2] for s in LINEAR_SUFFIXES}
                              | {"qkv_proj", "gate_up_proj"})
#: The registries of `sglang.srt.layers.quantization` that `fineslab_qoq` joins.
_REGISTRIES = ("QUANTIZATION_METHODS", "BASE_QUANTIZATION_METHODS", "CPU_QUANTIZATION_METHODS")


class QoQLinearConfig(QuantizationConfig):
    """The `quantization_config` of a QoQ checkpoint, as SGLang's loader sees it."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # plain torch: any device torch runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # read from config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QoQLinearConfig:
        """Raises ConfigError unless `config` is a 4-bit-weight, 8-bit-activation QoQ block."""
        if config.get("bits") != 4 or config.get("act_bits") != 8:
            raise ConfigError(f"{QUANT_METHOD}: bits {config.get('bits')} / act_bits "
                              f"{config.get('act_bits')}, want 4 / 8")
        if config.get("s1_dtype", "float16") != "float16":
            raise ConfigError(f"{QUANT_METHOD}: s1_dtype {config['s1_dtype']}, want float16")
        return cls(group_size=int(config["group_size"]))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str
                         ) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings and lm_head stay 16-bit
        if prefix.rpartition(".")[2] not in QUANTIZED_LINEARS:
            return UnquantizedLinearMethod()
        return QoQLinearMethod(self)

    def get_scaled_act_names(self) -> list[str]:
        return []


class QoQLinearMethod(LinearMethodBase):
    """Creates a layer's four QoQ tensors and computes its W4A8 product (module docstring)."""

    def __init__(self, config: QoQLinearConfig) -> None:
        self.config = config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        # `linear`, not `layer`: the contact scan takes a `layer` for SGLang's RadixAttention,
        # and what these methods touch on the LinearBase are torch calls and their own tensors.
        linear = layer
        group = layer_group_size(input_size, self.config.group_size)
        if input_size_per_partition % group:
            raise ConfigError(f"{QUANT_METHOD}: this rank's K = {input_size_per_partition} is "
                              f"not whole groups of {group}; use a smaller tensor parallelism")
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        shapes = {"qweight": ((rows, cols // 2), torch.uint8),
                  "s2": ((rows, cols // group), torch.uint8),
                  "zeros": ((rows, cols // group), torch.int8),
                  "s1": ((rows,), torch.float16)}
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            dims = {"output_dim": 0} if len(shape) == 1 else {"input_dim": 1, "output_dim": 0}
            set_weight_attrs(param, dims)
            set_weight_attrs(param, extra_weight_attrs)
            linear.register_parameter(name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the loaded tensors' invariants; unless the Triton GEMM will serve the layer,
        cache v_hat in INT8 and s1 in float32 for the torch path."""
        linear = layer
        weight = qoq_weight_of(linear)
        weight.check_integrity()
        if _triton_serves(weight):
            return
        linear.register_buffer("qoq_weight_int8", dequantize_qoq_to_int8(weight),
                               persistent=False)
        linear.register_buffer("qoq_s1", weight.s1.to(torch.float32), persistent=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        linear = layer
        if x.is_cuda and not hasattr(linear, "qoq_weight_int8"):
            from fineslab.quant.qoq_triton import w4a8_linear_triton

            return w4a8_linear_triton(x, qoq_weight_of(linear), bias)
        w_int8, s1 = _tensor(linear, "qoq_weight_int8"), _tensor(linear, "qoq_s1")
        out_features, in_features = w_int8.shape
        x_q, s_x = quantize_activations_int8(x.reshape(-1, in_features))
        acc = int8_matmul(x_q, w_int8)
        y = acc.to(torch.float32) * s_x[:, None] * s1[None, :]
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _triton_serves(weight: QoQWeight) -> bool:
    """Whether `apply` will take the Triton GEMM for this weight: it lies on CUDA, triton is
    importable (checked without importing it on CPU processes) and the kernel takes its group."""
    if not weight.packed.is_cuda or importlib.util.find_spec("triton") is None:
        return False
    from fineslab.quant.qoq_triton import supports_group_size

    return supports_group_size(weight.group_size)


def _tensor(linear: torch.nn.Module, name: str) -> torch.Tensor:
    """A tensor this method put on `linear` (a parameter or buffer), as a plain tensor."""
    found = getattr(linear, name)
    assert isinstance(found, torch.Tensor), f"{name} of a fineslab_qoq layer is not a tensor"
    return found.data


def qoq_weight_of(linear: torch.nn.Module) -> QoQWeight:
    """The `QoQWeight` a loaded layer holds (the group recovered from the shapes)."""
    packed, s2 = _tensor(linear, "qweight"), _tensor(linear, "s2")
    return QoQWeight(packed=packed, s2=s2, z=_tensor(linear, "zeros"), s1=_tensor(linear, "s1"),
                     group_size=2 * packed.shape[1] // s2.shape[1])


def register_qoq_method() -> None:
    """Make `fineslab_qoq` a quantization method of this process's SGLang (idempotent): in the
    dicts `get_quantization_config` and `ModelConfig` read, and in the `--quantization` choices.

    Raises EnvironmentSetupError when SGLang no longer keeps its methods in those dicts."""
    from sglang.srt.configs import model_config as model_config_module
    from sglang.srt.layers import quantization
    from sglang.srt.server_args import add_quantization_method_choices

    tables = [getattr(quantization, name, None) for name in _REGISTRIES]
    if (not all(isinstance(t, dict) for t in tables)
            or getattr(model_config_module, "QUANTIZATION_METHODS", None) is not tables[0]):
        raise EnvironmentSetupError(
            f"fineslab plugin: sglang.srt.layers.quantization no longer has the dicts "
            f"{_REGISTRIES} that ModelConfig reads; cannot register {QUANT_METHOD}")
    if QUANT_METHOD in quantization.QUANTIZATION_METHODS:
        return
    for table in tables:
        assert isinstance(table, dict)
        table[QUANT_METHOD] = QoQLinearConfig
    add_quantization_method_choices([QUANT_METHOD])
    logger.debug("fineslab plugin: registered quantization method %s", QUANT_METHOD)

"""The precision registry: the one place a precision is described.

A served precision is a weight format and a KV storage type. Everything that needs to know what
a precision is reads it here: the launcher's config (`precision:`, `kv_dtype: auto`), the
checkpoint preparation and SGLang arguments (`fineslab.quant.serving`), the plugin (the KV formats
it stores itself), the roofline profiles and the simulator (bytes per parameter, compute dtype,
KV dtype), and the precision tests and benchmark (`NAMED_PRECISIONS`). KV names and bytes per
token are `fineslab.slabs.formats.KVDtype` / `KVShape`, which this module builds on.

    weights  activations  auto KV    checkpoint method  --quantization   roofline B/param, compute
    bf16     bf16         bf16       -                  -                2.0, fp16
    fp16     fp16         fp16       -                  -                2.0, fp16
    fp8      bf16         bf16       fp8                GPU only (1)     1.0, fp8
    awq      fp16         fp16       awq                always           0.5 + 4/128, fp16
    qoq      bf16         int4       fineslab_qoq       never (2)        0.5 + 4/128, int8

(1) SGLang's fp8 linear is CUDA-only: on CPU the FP8 checkpoint is served dequantized to bf16.
(2) A plugin method: SGLang picks it from the checkpoint's config.json (the flag's choices are
parsed before a plugin could add to them).

The roofline figures are the papers' accounting (group 128 with 4 bytes of scale and zero per
group) for the analytical profiles of the paper's models; the checkpoints fineslab writes are a
little smaller (`fineslab.bench.precisions` measures them: `weight_ratio`). The `qoq` profile
assumes QServe's kernels: INT8 GEMMs (fineslab's Triton W4A8 GEMM on GPU) and a KV4 attention
kernel (on GPU fineslab's KV4 decodes with its Triton kernel through the plugin's `fineslab_kv4`
backend, prefill under torch_native; docs/precisions.md).

KV storage types the plugin stores itself (`KVStorage.plugin_pool_on`): int4 everywhere (SGLang
has no 4-bit KV; arena only), fp8_e4m3 on CPU (SGLang's CPU FP8 KV needs Intel AMX kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

from fineslab.errors import ConfigError
from fineslab.slabs.formats import KVDtype


@dataclass(frozen=True)
class WeightFormat:
    """How a precision's weights are stored and computed with."""

    name: str
    activation: KVDtype          # activations, and the KV "auto" stores (except qoq's)
    auto_kv: KVDtype             # what `kv_dtype: auto` means for this precision
    quant_method: str | None     # the checkpoint's quantization_config.quant_method
    quantization_flag: str       # when the runtime gets `--quantization <method>`: always|gpu|never
    roofline_bytes_per_param: float
    roofline_compute: str        # the tensor-core dtype of its GEMMs: fp16 | fp8 | int8

    @property
    def torch_dtype(self) -> str:
        """SGLang's `--dtype`: the activation dtype's torch name."""
        return self.activation.value

    def quantization_arg(self, cpu: bool) -> str | None:
        """The `--quantization` value a runtime of this precision is started with, if any."""
        if self.quant_method is None or self.quantization_flag == "never":
            return None
        if self.quantization_flag == "gpu" and cpu:
            return None
        return self.quant_method

    @property
    def picked_from_config(self) -> bool:
        """SGLang picks the method from config.json alone (no `--quantization`)."""
        return self.quant_method is not None and self.quantization_flag == "never"


#: The checkpoint quant_method of QoQ W4A8 (`fineslab.quant.qoq_checkpoint` writes it, the
#: plugin registers it with SGLang).
QOQ_METHOD = "fineslab_qoq"
_AWQ_BYTES = 0.5 + 4 / 128
#: The writers' groups: AWQ 64 (SmolLM2's hidden size 576 is not a multiple of 128); QoQ 128,
#: or per layer the largest power of two below it that divides K.
AWQ_GROUP_SIZE = 64
QOQ_GROUP_SIZE = 128

WEIGHT_FORMATS: dict[str, WeightFormat] = {w.name: w for w in (
    WeightFormat("bf16", KVDtype.BF16, KVDtype.BF16, None, "never", 2.0, "fp16"),
    WeightFormat("fp16", KVDtype.FP16, KVDtype.FP16, None, "never", 2.0, "fp16"),
    WeightFormat("fp8", KVDtype.BF16, KVDtype.BF16, "fp8", "gpu", 1.0, "fp8"),
    WeightFormat("awq", KVDtype.FP16, KVDtype.FP16, "awq", "always", _AWQ_BYTES, "fp16"),
    WeightFormat("qoq", KVDtype.BF16, KVDtype.INT4, QOQ_METHOD, "never", _AWQ_BYTES, "int8"),
)}


@dataclass(frozen=True)
class KVStorage:
    """How a KV storage type is kept on each device."""

    dtype: KVDtype
    arena_only: bool             # no SGLang pool stores it: `kv_pool: arena` only
    plugin_pool_on: tuple[str, ...]   # device kinds ("cpu", "gpu") where the plugin's pool does
    needs_scales: bool = False   # per-layer scales (SGLang's --quantization-param-path JSON)

    def plugin_pool(self, cpu: bool) -> bool:
        return ("cpu" if cpu else "gpu") in self.plugin_pool_on


KV_STORAGE: dict[KVDtype, KVStorage] = {s.dtype: s for s in (
    KVStorage(KVDtype.BF16, False, ()),
    KVStorage(KVDtype.FP16, False, ()),
    KVStorage(KVDtype.FP8_E4M3, False, ("cpu",), needs_scales=True),
    KVStorage(KVDtype.INT4, True, ("cpu", "gpu")),
)}
#: The `kv_dtype` names a fleet config accepts ("auto": the precision's `auto_kv`).
CONFIG_KV_DTYPES = ("auto", *(d.config_name for d in KV_STORAGE))
#: The KV formats the plugin's quantized pools store (FINESLAB_KV_FORMAT's values).
PLUGIN_KV_FORMATS = {d.config_name: d for d, s in KV_STORAGE.items() if s.plugin_pool_on}


@dataclass(frozen=True)
class Precision:
    """A named (weights, KV) pair: what the precision tests, the benchmark and the profiles
    call bf16, fp8, awq, kv4, qoq."""

    name: str
    weights: WeightFormat
    kv: KVDtype


def _named(name: str, weights: str, kv: KVDtype) -> Precision:
    return Precision(name, WEIGHT_FORMATS[weights], kv)


#: FineServe's precisions as (weights, KV): fp8 is W8A8KV8, qoq W4A8KV4; kv4 is QoQ's KV4 on
#: bf16 weights (KV4's own cost, beside qoq).
NAMED_PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    _named("bf16", "bf16", KVDtype.BF16),
    _named("fp16", "fp16", KVDtype.FP16),
    _named("fp8", "fp8", KVDtype.FP8_E4M3),
    _named("awq", "awq", KVDtype.FP16),
    _named("kv4", "bf16", KVDtype.INT4),
    _named("qoq", "qoq", KVDtype.INT4),
)}
#: The mixed fleet of the precision tests and benchmark.
FLEET_PRECISIONS = ("bf16", "fp8", "awq", "kv4", "qoq")


def weight_format(name: str) -> WeightFormat:
    """The weight format `name`; ConfigError listing the known ones."""
    if name not in WEIGHT_FORMATS:
        raise ConfigError(f"precision {name!r}: expected one of {sorted(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[name]


def named_precision(name: str) -> Precision:
    """The named precision `name`; ConfigError listing the known ones."""
    if name not in NAMED_PRECISIONS:
        raise ConfigError(f"precision {name!r}: expected one of {sorted(NAMED_PRECISIONS)}")
    return NAMED_PRECISIONS[name]


def config_kv_dtype(name: str) -> KVDtype:
    """A fleet config's `kv_dtype` name (not "auto") as the arena's storage type."""
    dtype = KVDtype.from_name(name)
    if dtype not in KV_STORAGE:
        raise ConfigError(f"kv dtype {name!r}: expected one of {CONFIG_KV_DTYPES}")
    return dtype

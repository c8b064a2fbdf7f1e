"""Analytical profiles: a roofline model from the model's config and a device spec.

Per TP rank, with P_lin the linear-layer parameters, n tokens in a step, c their mean context:

    prefill/decode step  t = max(FLOPs / (eta_c * peak(compute dtype)),
                                 bytes / (eta_m * HBM bandwidth)) + t_step
    FLOPs  = (2 * P_lin * n + 4 * layers * n * c * heads * head_dim) / TP
    bytes  = weights_bytes + R * kv_token_bytes (KV read) + n * kv_token_bytes (KV write)

For decode n = batch, c is the context and each sequence reads its own KV, R = n * c. For
prefill of a chunk of n fresh tokens c = n / 2 (causal) and a fused attention kernel reads the
chunk's KV about once, R = n. Throughput at batch b is b / t_decode(b, c_mean) tokens/s,
and the MME curve maps a KV pool of K bytes to the throughput of the batch it holds,
b(K) = K / (c_mean * kv_token_bytes * TP). Activation memory of one step (chunk plus decode
batch b) is estimated as
(C + b) * (4 * hidden + 2 * intermediate / TP) * 2 bytes + b * vocab * 4 bytes (FP32 logits).
The constants (eta_c = 0.6, eta_m = 0.8, t_step = 2 ms) are round numbers, not fits: these
profiles rank placements, they do not promise latencies. Measured profiles replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.devices import DeviceSpec, get_device
from fineslab.scheduler.kv_format import kv_token_bytes
from fineslab.scheduler.profile_schema import DecodeTable, ModelProfile, ModelShape, Workload

from fineslab.errors import ConfigError
from fineslab.precisions import NAMED_PRECISIONS

COMPUTE_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.8
STEP_OVERHEAD_S = 0.002
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192)
CONTEXT_TOKENS = (256, 1024, 2048, 4096, 8192)
DEFAULT_WORKLOAD = Workload(prompt_tokens=1024, output_tokens=256)
DEFAULT_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class Precision:
    """How a quantization scheme stores weights and KV and which tensor cores it uses."""

    name: str
    weight_bytes_per_param: float  # packed value plus group scales/zeros, averaged
    compute_dtype: str
    kv_dtype: str


#: Every named precision (`fineslab.precisions`, the registry) as the roofline sees it: the
#: papers' weight bytes per parameter, the GEMMs' dtype, the KV dtype. fp8 is W8A8KV8, awq
#: W4A16, qoq W4A8KV4 (INT8 GEMMs, INT4 KV with a per-token scale and zero).
PRECISIONS: dict[str, Precision] = {
    p.name: Precision(p.name, p.weights.roofline_bytes_per_param, p.weights.roofline_compute,
                      p.kv.profile_name)
    for p in NAMED_PRECISIONS.values()
}


def _shape(layers: int, hidden: int, heads: int, kv_heads: int, inter: int,
           vocab: int) -> ModelShape:
    head_dim = hidden // heads
    per_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
                 + 3 * hidden * inter)
    params = layers * per_layer + 2 * vocab * hidden  # untied embedding and lm_head
    return ModelShape(layers, hidden, heads, kv_heads, head_dim, inter, vocab, params)


#: The paper's models (Table 3), from their Hugging Face config.json.
MODEL_SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": _shape(32, 4096, 32, 8, 14336, 128256),
    "llama-3-8b": _shape(32, 4096, 32, 8, 14336, 128256),
    "llama-3.1-70b": _shape(80, 8192, 64, 8, 28672, 128256),
    "qwen3-32b": ModelShape(64, 5120, 64, 8, 128, 25600, 151936,
                            64 * (5120 * 64 * 128 * 2 + 5120 * 8 * 128 * 2 + 3 * 5120 * 25600)
                            + 2 * 151936 * 5120),
}

#: (model, precision) -> TP degree used in the catalog: the smallest that leaves room for KV.
PAPER_VARIANTS: dict[tuple[str, str], int] = {
    ("llama-3.1-8b", "fp16"): 1, ("llama-3.1-8b", "fp8"): 1, ("llama-3.1-8b", "awq"): 1,
    ("llama-3-8b", "qoq"): 1,
    ("llama-3.1-70b", "fp16"): 4, ("llama-3.1-70b", "fp8"): 2, ("llama-3.1-70b", "awq"): 1,
    ("qwen3-32b", "fp16"): 2, ("qwen3-32b", "fp8"): 1,
}


@dataclass(frozen=True)
class Roofline:
    """Step latencies of one model shard on one device."""

    shape: ModelShape
    precision: Precision
    device: DeviceSpec
    tp: int

    @property
    def weights_bytes(self) -> int:
        s = self.shape
        embed_params = 2 * s.vocab_size * s.hidden_size  # kept in FP16 by every scheme
        linear_bytes = (s.num_params - embed_params) * self.precision.weight_bytes_per_param
        return int((linear_bytes + embed_params * 2.0) / self.tp)

    @property
    def kv_token_bytes(self) -> int:
        s = self.shape
        return kv_token_bytes(s.num_layers, s.num_kv_heads, s.head_dim,
                              self.precision.kv_dtype, self.tp)

    def step_s(self, num_tokens: int, context_tokens: float, prefill: bool = False) -> float:
        s = self.shape
        kv_read_tokens = num_tokens if prefill else num_tokens * context_tokens
        linear_params = s.num_params - s.vocab_size * s.hidden_size  # lm_head runs, embed not
        flops = (2 * linear_params * num_tokens
                 + 4 * s.num_layers * num_tokens * context_tokens * s.num_heads * s.head_dim)
        flops /= self.tp
        moved = (self.weights_bytes + (kv_read_tokens + num_tokens) * self.kv_token_bytes)
        compute_s = flops / (COMPUTE_EFFICIENCY * self.device.peak_flops(
            self.precision.compute_dtype))
        memory_s = moved / (MEMORY_EFFICIENCY * self.device.hbm_bytes_per_s)
        return max(compute_s, memory_s) + STEP_OVERHEAD_S

    def activation_bytes(self, batch_size: int, chunk_tokens: int) -> int:
        s = self.shape
        per_token = (4 * s.hidden_size + 2 * s.intermediate_size / self.tp) * 2
        return int((chunk_tokens + batch_size) * per_token + batch_size * s.vocab_size * 4)


def analytical_profile(model: str, precision: str, device: str,
                       workload: Workload = DEFAULT_WORKLOAD,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                       tp: int | None = None,
                       shape: ModelShape | None = None) -> ModelProfile:
    """The roofline profile of a catalogued model (see the module docstring); `shape` profiles
    a model outside the catalogue under the name `model` (its config.json's shape)."""
    if (shape is None and model not in MODEL_SHAPES) or precision not in PRECISIONS:
        raise ConfigError(f"no analytical model for {model!r} {precision!r}; models: "
                          f"{sorted(MODEL_SHAPES)}, precisions: {sorted(PRECISIONS)}")
    tp = tp or PAPER_VARIANTS.get((model, precision), 1)
    roof = Roofline(shape or MODEL_SHAPES[model], PRECISIONS[precision], get_device(device), tp)
    ctx = workload.mean_context_tokens
    throughput = [(b, b / roof.step_s(b, ctx)) for b in BATCH_SIZES]
    kv_per_request = ctx * roof.kv_token_bytes * tp
    return ModelProfile(
        source="analytical", model=model, precision=precision, device=roof.device.name, tp=tp,
        kv_dtype=roof.precision.kv_dtype, shape=roof.shape, weights_bytes=roof.weights_bytes,
        kv_token_bytes=roof.kv_token_bytes, device_memory_bytes=roof.device.memory_bytes,
        chunk_tokens=chunk_tokens, workload=workload,
        activation_bytes=PiecewiseLinear.from_points(
            [(b, roof.activation_bytes(b, chunk_tokens)) for b in BATCH_SIZES]),
        prefill_s=PiecewiseLinear.from_points(
            [(n, roof.step_s(n, n / 2, prefill=True)) for n in PREFILL_TOKENS]),
        decode=DecodeTable(BATCH_SIZES, CONTEXT_TOKENS, tuple(
            tuple(roof.step_s(b, c) for c in CONTEXT_TOKENS) for b in BATCH_SIZES)),
        throughput_tokens_per_s=PiecewiseLinear.from_points(throughput),
        mme=PiecewiseLinear.from_points([(0.0, 0.0)] + [
            (b * kv_per_request, tps) for b, tps in throughput]),
        provenance={"command": "python -m fineslab.profile analytical",
                    "model_formula": "fineslab.scheduler.roofline"},
    )


def paper_profiles(devices: tuple[str, ...] = ("h100", "h200", "a100")) -> list[ModelProfile]:
    """The analytical profile of every paper variant on every device in `devices`."""
    return [analytical_profile(model, precision, device)
            for device in devices for (model, precision) in PAPER_VARIANTS]

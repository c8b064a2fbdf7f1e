"""Mixed precision for the fleet: quantized checkpoints and the KV4 cache format.

Precisions fineslab serves (docs/precisions.md has the gates and measured numbers):
    bf16 / fp16   plain checkpoints
    fp8           W8A8 (SGLang's `fp8` method) + FP8 KV with per-layer scales  -> `fp8`
    awq           W4A16 (SGLang's native `awq` method)                          -> `awq`
    qoq           W4A8 (a QoQ checkpoint, the plugin's `fineslab_qoq` method) + KV4  -> `qoq`
    kv4           bf16 weights + 4-bit KV with per-token per-head scale and zero inside the
                  slab block (ours)                                             -> `kv4`

Public API
    write_awq_checkpoint(src, out, AWQConfig(group_size)) -> Path    (fineslab.quant.awq)
    write_dequantized_reference(awq_dir, out) -> Path                 the AWQ model in fp16
    write_fp8_checkpoint(src, out) -> Path; load_kv_scales(model_dir) (fineslab.quant.fp8)
    verify_checkpoint(model_dir) -> quant method | None               (fineslab.quant.verify)
        raises ConfigError naming every missing or mis-shaped tensor
    quantize_kv4(x) -> (packed, params); dequantize_kv4(packed, params, dtype); Kv4Reader
                                                                      (fineslab.quant.kv4)
    quantize_qoq(w, QoQConfig(group_size)) -> QoQWeight; w4a8_linear(x, w)  (fineslab.quant.qoq)
    kv4_decode_attention(...)   Triton decode kernel over KV4 slots   (fineslab.quant.kv4_triton,
                                imports triton; CPU only under TRITON_INTERPRET=1)
    prepare_served_model(name, weights, kv, src, out, device=) -> PrecisionRuntime
                                checkpoint + SGLang args + KV env of any (weights, KV) pair,
                                reused while the source is unchanged (fineslab.quant.serving)
    verify_runtime(runtime)     the served checkpoint and FP8 scales file, before a start
    prepare_runtime(precision, src, work, device) -> PrecisionRuntime   a named precision
                                (bf16/fp8/awq/kv4/qoq)
    (the precisions in one arena for tests and the benchmark: fineslab.bench.precision_fleet;
    what each precision is: the registry, fineslab.precisions)
    compare_top_logprobs(ref, got) -> GateResult; perplexity(result)  (fineslab.quant.gates)

Modules import torch; none imports SGLang (the KV4 pool lives in fineslab.sglang_plugin).
"""

from __future__ import annotations

from fineslab.quant.awq import AWQConfig, write_awq_checkpoint, write_dequantized_reference
from fineslab.quant.kv4 import Kv4Reader, dequantize_kv4, quantize_kv4
from fineslab.quant.verify import verify_checkpoint

__all__ = [
    "AWQConfig", "Kv4Reader", "dequantize_kv4", "quantize_kv4", "verify_checkpoint",
    "write_awq_checkpoint", "write_dequantized_reference",
]

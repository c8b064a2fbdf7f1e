"""What only a GPU can show: FP8 W8A8 + FP8 KV (tensor cores), AWQ and the Triton KV4 kernel.

Run by scripts/gpu_check.sh (`-m gpu`); skipped without CUDA. Bounds as on CPU: the Triton
kernel within 1e-3 of the plain-torch reference (fp32 accumulate, GPU exp), AWQ prompt logprobs
within 0.1 of transformers on the dequantized weights, FP8 W8A8KV8 perplexity within 1.25x of
bf16 on the fixed text (a random model when SmolLM2 is absent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fineslab.runtime import shutdown_engine, start_engine

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TEXT = ("Large language models are served from GPUs whose memory holds the weights and the key "
        "value cache of every model that shares the device.")


def test_triton_kv4_kernel_on_cuda() -> None:
    from fineslab.quant.kv4 import quantize_kv4
    from fineslab.quant.kv4_triton import kv4_decode_attention, kv4_decode_attention_reference

    gen = torch.Generator().manual_seed(0)
    slots, kv_heads, head_dim, q_heads = 4096, 8, 128, 32
    kp, ks = quantize_kv4(torch.randn(slots, kv_heads, head_dim, generator=gen).cuda())
    vp, vs = quantize_kv4(torch.randn(slots, kv_heads, head_dim, generator=gen).cuda())
    req_to_token = torch.randperm(slots, generator=gen).to(torch.int32).reshape(4, 1024).cuda()
    req_idx = torch.tensor([3, 1, 0], device="cuda")
    seq_lens = torch.tensor([1024, 333, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(3, q_heads, head_dim, generator=gen).cuda()
    args = (q, kp, ks, vp, vs, req_to_token, req_idx, seq_lens, head_dim ** -0.5)
    got = kv4_decode_attention(*args)
    assert float((got - kv4_decode_attention_reference(*args)).abs().max()) <= 1e-3


def _engine_logprobs(model: Path, **kwargs: Any) -> list[float]:

    engine = start_engine(model_path=str(model), log_level="error", mem_fraction_static=0.3,
                           **kwargs)
    try:
        out = engine.generate(TEXT, {"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
    finally:
        shutdown_engine(engine)
    return [float(lp) for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]]


def test_awq_on_gpu_matches_dequantized_reference(model_cache: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fineslab.quant.awq import write_awq_checkpoint, write_dequantized_reference

    awq = write_awq_checkpoint(model_cache / "llama-tiny", tmp_path / "awq")
    ref = write_dequantized_reference(awq, tmp_path / "ref")
    got = torch.tensor(_engine_logprobs(awq, quantization="awq", dtype="float16"))
    ids = AutoTokenizer.from_pretrained(ref)(TEXT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    with torch.no_grad():
        lp = model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    assert float((got - lp).abs().max()) <= 0.1


def test_fp8_w8a8kv8_on_gpu_within_gate(model_cache: Path, tmp_path: Path) -> None:
    import math

    from fineslab.quant.serving import prepare_runtime

    src = model_cache / "llama-tiny"
    fp8 = prepare_runtime("fp8", src, tmp_path, device="cuda")
    args = dict(zip(fp8.server_args[::2], fp8.server_args[1::2], strict=True))
    got = _engine_logprobs(fp8.model_path, dtype="bfloat16", quantization="fp8",
                           kv_cache_dtype="fp8_e4m3",
                           quantization_param_path=args["--quantization-param-path"])
    ref = _engine_logprobs(src, dtype="bfloat16")
    ratio = math.exp(-sum(got) / len(got)) / math.exp(-sum(ref) / len(ref))
    assert ratio <= 1.25, f"FP8 W8A8KV8 perplexity ratio {ratio:.3f}"

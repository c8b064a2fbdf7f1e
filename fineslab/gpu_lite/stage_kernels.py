"""Stages `precisions` and `bench` of the staged device check (`fineslab.gpu_lite.check`).

    precisions  the four precisions' kernels on the device against their CPU references, each
                with a corrupted operand that the same comparison must catch: FP8 W8A8 (the
                gpu-lite fallback's per-token activation quant through SGLang's own wrapper,
                then the scaled GEMM), AWQ W4A16 (SGLang's `awq_dequantize`, here the fallback,
                then the matmul), KV4 decode attention (the `fineslab_kv4` backend's Triton
                kernel, and one decode step of the backend against SGLang's torch_native over
                the same KV4 pool) and QoQ W4A8 (its Triton GEMM, bit for bit). Then SGLang serves
                llama-tiny as AWQ (both devices: prompt logprobs within 0.1 of transformers on
                the dequantized weights) and, on CUDA only, as FP8 W8A8KV8 (perplexity within
                1.25x of transformers' bf16 model; SGLang's FP8 linear is CUDA-only)
    bench       `python -m fineslab.bench.alloc --json` (quick: 5,000 steps, one replay) and
                `fineslab.bench.pool`'s comparison (slab pool against SGLang's own, 4 requests
                x 16 tokens, 2 rounds) with the gpu-lite runtime arguments on CUDA

On CPU the Triton kernels run under the interpreter (`TRITON_INTERPRET=1`, set before triton
is first imported in the stage's process), at small sizes; on CUDA compiled, at serving sizes.
Checkpoints are generated from the carried llama-tiny (fineslab.quant writers), nothing from a
hub. The figures are the stage's JSON; `ok` is every check's verdict.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fineslab.gpu_lite.runtime_args import CUDA_ARGS, model_dir

TEXT = ("Large language models are served from GPUs whose memory holds the weights and the key "
        "value cache of every model that shares the device.")
#: Gates as tests/precisions/test_precisions_gpu.py sets them.
AWQ_MAX_LOGPROB_DIFF = 0.1
FP8_MAX_PPL_RATIO = 1.25


#: Triton 3.6's interpreter under NumPy >= 2.5 (the CPU twin's pair) fails any kernel whose
#: loop bound is a loaded value (`int()` of a 1-element array); compiled kernels are unaffected.
INTERPRETER_DEFECT = "only 0-dimensional arrays can be converted to Python scalars"
INTERPRETER_SKIP = ("this CPU's Triton interpreter cannot run the kernel (Triton 3.6 with "
                    "NumPy >= 2.5); the CPU suite checks it under its own Triton "
                    "(tests/precisions), a GPU compiles it")


def _prepare_triton(device: str) -> None:
    """On CPU, Triton kernels need the interpreter, which is read when triton is imported."""
    if device == "cpu" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def _dev(device: str) -> torch.device:
    return torch.device("cuda:0" if device == "cuda" else "cpu")


def check_fp8_linear(device: str) -> dict[str, Any]:
    """SGLang's per-token FP8 quant wrapper (the fallback behind it) and the W8A8 GEMM SGLang
    runs after it (its `fp8_scaled_mm`: `torch._scaled_mm` row-wise with
    `SGLANG_FORCE_FUSED_OP_BACKEND=torch`, bf16 out; on CPU the same product in float32) against
    the float matmul of the dequantized operands; then with the activations' scales rolled by
    one row, which must break it."""
    import sgl_kernel  # noqa: F401  (the stand-in registers the fallbacks; real: no-op here)
    from sglang.kernels.ops.quantization import sgl_per_token_quant_fp8

    from fineslab.quant.fp8 import quantize_fp8_per_token

    dev, gen = _dev(device), torch.Generator().manual_seed(0)
    tokens, k, n = (64, 512, 256) if device == "cuda" else (8, 128, 64)
    x = torch.randn(tokens, k, generator=gen).to(dev, torch.bfloat16)
    w_q, w_s = quantize_fp8_per_token(torch.randn(n, k, generator=gen).to(dev))  # per channel
    x_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=dev)
    x_s = torch.empty(tokens, 1, dtype=torch.float32, device=dev)
    sgl_per_token_quant_fp8(x, x_q, x_s)
    ref_q, ref_s = quantize_fp8_per_token(x.cpu())

    def gemm(scales: torch.Tensor) -> torch.Tensor:
        if device == "cuda":  # what apply_fp8_linear calls: Fp8ScaledMMOp, torch._scaled_mm
            from sglang.kernels.ops.gemm import fp8_scaled_mm

            return fp8_scaled_mm(x_q, w_q.t(), scales, w_s.t(), torch.bfloat16).float()
        return (x_q.float() * scales) @ (w_q.float() * w_s).t()

    want = (ref_q.float() * ref_s) @ (w_q.float().cpu() * w_s.cpu()).t()
    tolerance = 1e-2 * float(want.abs().max())  # bf16 output (2^-8) and fast accumulation
    diff = float((gemm(x_s).cpu() - want).abs().max())
    control = float((gemm(x_s.roll(1, 0)).cpu() - want).abs().max())
    quant_equal = torch.equal(x_q.cpu().float(), ref_q.float()) and torch.equal(x_s.cpu(), ref_s)
    return {"ok": quant_equal and diff <= tolerance < control, "quant_equal": quant_equal,
            "gemm_max_diff": diff, "tolerance": tolerance, "control_max_diff": control}


def check_awq_dequant(device: str) -> dict[str, Any]:
    """SGLang's `awq_dequantize` (as awq_kernels imports it) then the matmul, against the
    unpacked reference (`QuantizedLinear.dequantize`); zero points off by one must break it."""
    import sgl_kernel  # noqa: F401
    from sglang.srt.hardware_backend.gpu.quantization import awq_kernels

    from fineslab.quant.awq import pack_int4, quantize_linear

    dev, gen = _dev(device), torch.Generator().manual_seed(1)
    n, k, group = (1024, 2048, 128) if device == "cuda" else (128, 256, 64)
    ql = quantize_linear(torch.randn(n, k, generator=gen), group)
    qweight, qzeros, scales = (pack_int4(ql.values).to(dev), pack_int4(ql.zeros).to(dev),
                               ql.scales.to(dev))
    x = torch.randn(16, k, generator=gen, dtype=torch.float32).to(torch.float16)
    weight = awq_kernels.awq_dequantize(qweight, scales, qzeros)
    wrong = awq_kernels.awq_dequantize(qweight, scales, pack_int4((ql.zeros + 1) % 16).to(dev))
    reference = ql.dequantize()
    out = (x.to(dev) @ weight).float().cpu()
    want = x.float() @ reference.float()
    diff = float((out - want).abs().max())
    tolerance = 2e-3 * float(want.abs().max())  # fp16 accumulation on the device
    exact = torch.equal(weight.cpu(), reference)
    caught = not torch.equal(wrong.cpu(), reference)
    return {"ok": exact and diff <= tolerance and caught, "dequant_exact": exact,
            "matmul_max_diff": diff, "tolerance": tolerance, "control_caught": caught}


def check_kv4_decode(device: str) -> dict[str, Any]:
    """The `fineslab_kv4` backend's Triton decode kernel against its plain-torch reference
    (GQA, ragged lengths); one request's K scales doubled must move it past the bound."""
    from fineslab.quant.kv4 import quantize_kv4
    from fineslab.quant.kv4_triton import kv4_decode_attention, kv4_decode_attention_reference

    dev, gen = _dev(device), torch.Generator().manual_seed(0)
    slots, kv_heads, head_dim, q_heads, per_req = ((4096, 8, 128, 32, 1024) if device == "cuda"
                                                   else (256, 2, 64, 4, 64))
    kp, ks = quantize_kv4(torch.randn(slots, kv_heads, head_dim, generator=gen).to(dev))
    vp, vs = quantize_kv4(torch.randn(slots, kv_heads, head_dim, generator=gen).to(dev))
    req_to_token = torch.randperm(slots, generator=gen).to(torch.int32).reshape(
        -1, per_req).to(dev)
    req_idx = torch.tensor([3, 1, 0], device=dev)
    seq_lens = torch.tensor([per_req, per_req // 3, 1], dtype=torch.int32, device=dev)
    q = torch.randn(3, q_heads, head_dim, generator=gen).to(dev)
    args = (q, kp, ks, vp, vs, req_to_token, req_idx, seq_lens, head_dim ** -0.5)
    want = kv4_decode_attention_reference(*args)
    diff = float((kv4_decode_attention(*args) - want).abs().max())
    broken = ks.clone()
    broken[..., 0] *= 2  # every slot's K scale doubled
    control = float((kv4_decode_attention(q, kp, broken, *args[3:]) - want).abs().max())
    bound = 1e-3
    return {"ok": diff <= bound < control, "max_diff": diff, "bound": bound,
            "control_max_diff": control}


def check_kv4_backend(device: str) -> dict[str, Any]:
    """One decode step of the `fineslab_kv4` backend (`Kv4AttnBackend`, the Triton kernel over
    the pool's packed views) against SGLang's `TorchNativeAttnBackend` over the same
    `Kv4SlabKVPool` (GQA 4 on 2, 4 requests of 1 to 40 tokens on shuffled slots), float32;
    a doubled sm_scale must move it past the bound."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from fineslab.sglang_plugin.kv4_backend import Kv4AttnBackend
    from fineslab.sglang_plugin.quant_pools import Kv4SlabKVPool
    from fineslab.slabs import BlockFormat, KVDtype, KVShape
    from fineslab.slabs.views import layer_views

    dev, gen = _dev(device), torch.Generator().manual_seed(11)
    layers, kv_heads, q_heads, head_dim, page, seq_lens = 2, 2, 4, 64, 16, [1, 7, 23, 40]
    fmt = BlockFormat.unpadded(KVShape("m", layers, kv_heads, head_dim, KVDtype.INT4), page)
    arena = torch.zeros(fmt.token_stride_bytes * 16 * page, dtype=torch.uint8, device=dev)
    pool = Kv4SlabKVPool.over(layer_views(arena, fmt))(
        size=12 * page, page_size=page, dtype=torch.float32, head_num=kv_heads,
        head_dim=head_dim, layer_num=layers, device=str(dev), enable_memory_saver=False)
    slots = torch.randperm(12 * page - 1, generator=gen)[: sum(seq_lens)] + 1  # 0: padding
    req_to_token = torch.zeros(6, 64, dtype=torch.int32)
    req_pool_indices = torch.tensor([4, 0, 2, 5])
    ends = torch.tensor(seq_lens).cumsum(0).tolist()
    for b, (n, end) in enumerate(zip(seq_lens, ends, strict=True)):
        req_to_token[req_pool_indices[b], :n] = slots[end - n:end].int()
    prefix = torch.cat([slots[end - n:end - 1] for n, end in zip(seq_lens, ends, strict=True)])
    new_loc = torch.stack([slots[end - 1] for end in ends]).long().to(dev)

    def layer(scaling: float) -> Any:
        return SimpleNamespace(layer_id=1, tp_q_head_num=q_heads, tp_k_head_num=kv_heads,
                               qk_head_dim=head_dim, v_head_dim=head_dim, scaling=scaling,
                               is_cross_attention=False, sliding_window_size=-1, logit_cap=0.0)

    def kv(n: int) -> torch.Tensor:
        return (torch.randn(n, kv_heads, head_dim, generator=gen) * 3).to(dev)

    pool.set_kv_buffer(layer(0.125), prefix.to(dev), kv(len(prefix)), kv(len(prefix)))
    batch = SimpleNamespace(out_cache_loc=new_loc, req_pool_indices=req_pool_indices.to(dev),
                            seq_lens=torch.tensor(seq_lens, device=dev), encoder_lens=None,
                            encoder_out_cache_loc=None)
    runner = SimpleNamespace(device=str(dev), token_to_kv_pool=pool,
                             req_to_token_pool=SimpleNamespace(req_to_token=req_to_token.to(dev)))
    native, kv4 = TorchNativeAttnBackend(runner), Kv4AttnBackend(runner)
    q, k_new, v_new = (torch.randn(4, q_heads * head_dim, generator=gen).to(dev), kv(4), kv(4))
    scale = head_dim ** -0.5
    want = native.forward_decode(q, k_new, v_new, layer(scale), batch)
    diff = float((kv4.forward_decode(q, k_new, v_new, layer(scale), batch) - want).abs().max())
    control = float((kv4.forward_decode(q, k_new, v_new, layer(2 * scale), batch)
                     - want).abs().max())
    bound = 1e-3 if device == "cuda" else 1e-5  # as the GPU test bounds the kernel
    kernel_on = kv4._kv4_kernel is not None
    return {"ok": kernel_on and diff <= bound < control, "kernel_on": kernel_on,
            "max_diff": diff, "bound": bound, "control_max_diff": control}


def check_qoq_gemm(device: str) -> dict[str, Any]:
    """The QoQ W4A8 Triton GEMM: its INT32 accumulator equal to `int8_matmul` and its float32
    output within 1e-5 of `w4a8_linear` (bit for bit under the interpreter); swapped nibbles
    must break it."""
    from fineslab.quant.qoq import (
        QoQConfig,
        QoQWeight,
        dequantize_qoq_to_int8,
        int8_matmul,
        quantize_activations_int8,
        quantize_qoq,
        w4a8_linear,
    )
    from fineslab.quant.qoq_triton import w4a8_gemm_int32, w4a8_linear_triton

    dev, gen = _dev(device), torch.Generator().manual_seed(2)
    cases = [(1, 1024, 1024), (40, 1024, 1024)] if device == "cuda" else [(1, 40, 256),
                                                                          (7, 33, 192)]
    rows = []
    for tokens, n, k in cases:
        w = quantize_qoq(torch.randn(n, k, generator=gen), QoQConfig(group_size=64))
        w = QoQWeight(w.packed.to(dev), w.s2.to(dev), w.z.to(dev), w.s1.to(dev), w.group_size)
        x = torch.randn(tokens, k, generator=gen).to(dev)
        x_q, _ = quantize_activations_int8(x)
        want_acc = int8_matmul(x_q.cpu(), dequantize_qoq_to_int8(w).cpu(), use_int_mm=False)
        swapped = QoQWeight((w.packed << 4) | (w.packed >> 4), w.s2, w.z, w.s1, w.group_size)
        got = w4a8_linear_triton(x, w).cpu()
        want = w4a8_linear(x.cpu(), QoQWeight(w.packed.cpu(), w.s2.cpu(), w.z.cpu(),
                                              w.s1.cpu(), w.group_size), use_int_mm=False)
        rows.append({"tokens": tokens, "n": n, "k": k,
                     "acc_equal": torch.equal(w4a8_gemm_int32(x_q, w).cpu(), want_acc),
                     "out_max_diff": float((got.float() - want.float()).abs().max()),
                     "control_caught": not torch.equal(w4a8_gemm_int32(x_q, swapped).cpu(),
                                                       want_acc)})
    # float32 out: equal on CPU; on a GPU within the gpu test's 1e-5 (FMA contraction)
    ok = all(r["acc_equal"] and r["out_max_diff"] <= 1e-5 and r["control_caught"] for r in rows)
    return {"ok": ok, "cases": rows}


def _prompt_logprobs(base_url: str, ids: list[int]) -> list[float]:
    import httpx

    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    reply = httpx.post(base_url + "/generate", json=body, timeout=300)
    reply.raise_for_status()
    return [float(lp) for lp, *_ in reply.json()["meta_info"]["input_token_logprobs"][1:]]


def _transformers_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    lp = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [float(v) for v in lp]


def _serve_logprobs(runtime: Any, device: str, log: Path, ids: list[int]) -> list[float]:
    from fineslab.runtime import ServerProcess, ServerSpec, free_port

    args = (*runtime.server_args, "--log-level", "warning", "--grammar-backend", "none",
            *(CUDA_ARGS if device == "cuda" else ()))
    spec = ServerSpec(str(runtime.model_path), free_port(), cpu=device == "cpu",
                      extra_args=args, env=dict(runtime.kv_env))
    server = ServerProcess(spec, log, warm=False)
    try:
        server.wait_healthy(240)
        return _prompt_logprobs(spec.base_url, ids)
    finally:
        server.stop()


def _fallback_overrode(log: Path) -> bool:
    """Whether the runtime's log says SGLang defined a fallback's op before the stand-in did
    (`fallbacks.register`): then an eagerly bypassed op may still reach SGLang's JIT kernel."""
    return log.exists() and "before fineslab's gpu-lite fallback" in log.read_text(
        errors="replace")


def check_served(device: str, out: Path) -> dict[str, Any]:
    """SGLang serving llama-tiny as AWQ (both devices) and FP8 W8A8KV8 (CUDA), each against
    transformers in float32 on this process's CPU."""
    from transformers import AutoTokenizer

    from fineslab.quant.awq import write_dequantized_reference
    from fineslab.quant.serving import prepare_runtime

    src = model_dir("llama-tiny")
    ids = [int(t) for t in AutoTokenizer.from_pretrained(src)(TEXT).input_ids]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fineslab-precisions-") as tmp:
        work = Path(tmp)
        awq = prepare_runtime("awq", src, work, device=device)
        want = _transformers_logprobs(
            write_dequantized_reference(awq.model_path, work / "awq-ref"), ids)
        log = out / "precisions-awq.log"
        got = _serve_logprobs(awq, device, log, ids)
        diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
        results["awq"] = {"ok": diff <= AWQ_MAX_LOGPROB_DIFF, "max_logprob_diff": diff,
                          "bound": AWQ_MAX_LOGPROB_DIFF, "server_args": list(awq.server_args),
                          "fallback_overrode": _fallback_overrode(log)}
        if device == "cuda":
            fp8 = prepare_runtime("fp8", src, work, device=device)
            log = out / "precisions-fp8.log"
            got = _serve_logprobs(fp8, device, log, ids)
            ref = _transformers_logprobs(src, ids)
            ratio = math.exp((sum(ref) - sum(got)) / len(got))
            results["fp8"] = {"ok": ratio <= FP8_MAX_PPL_RATIO, "ppl_ratio": ratio,
                              "bound": FP8_MAX_PPL_RATIO, "server_args": list(fp8.server_args),
                              "fallback_overrode": _fallback_overrode(log)}
        else:
            results["fp8"] = {"ok": True, "skipped": "SGLang's FP8 linear is CUDA-only; on CPU "
                              "fineslab serves FP8 dequantized (tests/precisions)"}
    return results


def stage_precisions(device: str, out: Path) -> dict[str, Any]:
    _prepare_triton(device)
    import sgl_kernel

    # a carry built before the fallbacks holds a stand-in without them: say so first
    figures: dict[str, Any] = {"device": device, "sgl_kernel": sgl_kernel.__version__,
                               "stand_in_has_fallbacks": "_register_fallbacks" in vars(sgl_kernel)}
    checks = {"fp8_linear": check_fp8_linear, "awq_dequant": check_awq_dequant,
              "kv4_decode": check_kv4_decode, "kv4_backend": check_kv4_backend,
              "qoq_gemm": check_qoq_gemm}
    for name, check in checks.items():
        start_s = time.monotonic()
        try:
            figures[name] = check(device)
        except Exception as exc:  # one check's failure is its figure; the next still runs
            figures[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
            if device == "cpu" and INTERPRETER_DEFECT in str(exc):
                figures[name] = {"ok": True, "skipped": INTERPRETER_SKIP, "error": str(exc)}
        figures[name]["seconds"] = round(time.monotonic() - start_s, 1)
    start_s = time.monotonic()
    try:
        figures["served"] = check_served(device, out)
    except Exception as exc:
        figures["served"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    figures["served_seconds"] = round(time.monotonic() - start_s, 1)
    served = figures["served"]
    figures["ok"] = (all(figures[name]["ok"] for name in checks) and "error" not in served
                     and all(s["ok"] for s in served.values()))
    return figures


def stage_bench(device: str, out: Path) -> dict[str, Any]:
    """bench.alloc's JSON line, and bench.pool's tok/s of each side on the gpu-lite runtime."""
    # The harness stops a stage past its time with SIGTERM to its group: exit through the
    # `finally`s, so that bench.pool's arena is unlinked (a plain SIGTERM left it in /dev/shm)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from statistics import median

    from fineslab.bench.pool import BenchConfig, compare

    command = [sys.executable, "-m", "fineslab.bench.alloc", "--steps", "5000", "--repeats",
               "1", "--device", device, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    (out / "bench-alloc.log").write_text(done.stdout + done.stderr)
    figures: dict[str, Any] = {"alloc_command": " ".join(command[1:])}
    if done.returncode == 0:
        alloc = json.loads(done.stdout.strip().splitlines()[-1])
        figures["alloc"] = {key: alloc[key] for key in (
            "sglang_ns_per_page", "slab_ns_per_page", "slab_pooled_ns_per_page", "ratio",
            "pooled_ratio", "pages_per_replay") if key in alloc}
    else:
        figures["alloc"] = {"error": f"exited {done.returncode}: {done.stderr[-500:]}"}
    cfg = BenchConfig(model="llama-tiny", page_size=16, num_requests=4, prompt_tokens=8,
                      new_tokens=16, rounds=2, capacity_tokens=2048)
    # On CUDA the gpu-lite runtime: triton attention, torch sampling, no CUDA graphs (CUDA_ARGS
    # has its own --max-total-tokens, so the stock side's capacity is the config's, set after)
    backend_args = (*CUDA_ARGS[:-2], "--grammar-backend", "none") if device == "cuda" else (
        "--grammar-backend", "none")
    (out / "bench-pool").mkdir(exist_ok=True)
    try:
        rates = compare(cfg, model_dir("llama-tiny"), out / "bench-pool", cpu=device == "cpu",
                        backend_args=backend_args)
        figures["pool_tokens_per_s"] = {side: [round(r, 1) for r in rs]
                                        for side, rs in rates.items()}
        figures["pool_ratio"] = round(median(rates["plugin"]) / median(rates["stock"]), 3)
    except Exception as exc:
        figures["pool_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    figures["ok"] = "error" not in figures["alloc"] and "pool_error" not in figures
    return figures

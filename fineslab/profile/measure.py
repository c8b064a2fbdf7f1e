"""Measure a profile by driving a real SGLang runtime on this device.

What is measured and how (wall clock around `sglang.Engine.generate`, radix cache off so that
repeated prompts are prefilled every time, random token ids, best of `repeats` because other
processes on a shared machine only ever add time):

    raw prefill[n]      one request of n prompt tokens, max_new_tokens = 1
    raw step[b][c]      (t(b prompts of c tokens, D new tokens) - t(same, 1 new token)) / (D - 1)
    prefill_s(n)        = a + beta * n, non-negative least squares over the raw prefill points
    decode(b, c)        = a + beta * b + gamma * b * c, non-negative least squares over raw steps
    throughput[b]       b / decode(b, workload mean context)        tokens/s
    mme                 derived from throughput as in the roofline (KV bytes a batch holds)

The fits make the tables monotone and smooth; on a loaded 2-core machine single timings of the
tiny model vary by 10x, so raw points would rank nothing. The raw points are kept in the
provenance.

Weights bytes come from the safetensors header, KV bytes per token from the KV block formula;
activation memory is not measurable on CPU and uses the roofline estimate (the provenance says
so). A quick CPU run of llama-tiny takes about 30 s, half of it engine start.
This module imports sglang; nothing in `fineslab.scheduler` does.
"""

from __future__ import annotations

import json
import logging
import platform
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fineslab import cpu_mode
from fineslab.models.checkpoint import read_shape, safetensors_bytes_and_params
from fineslab.models.generate import ensure_model
from fineslab.runtime import cpu_engine_kwargs, shutdown_engine, start_engine
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.kv_format import kv_token_bytes
from fineslab.scheduler.profile_schema import (
    DecodeTable,
    ModelProfile,
    ModelShape,
    Workload,
    save_profile,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class MeasureConfig:
    model: str
    cache_dir: Path
    out_dir: Path
    quick: bool = False
    chunk_tokens: int = 256
    decode_tokens: int = 16
    repeats: int = 3
    device: str = "cpu"
    seed: int = 0
    max_total_tokens: int = 32768

    @property
    def prefill_tokens(self) -> tuple[int, ...]:
        return (16, 64, 256) if self.quick else (16, 64, 128, 256, 512)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return (1, 4) if self.quick else (1, 4, 16)

    @property
    def context_tokens(self) -> tuple[int, ...]:
        return (32, 128)

    @property
    def workload(self) -> Workload:
        return Workload(prompt_tokens=96, output_tokens=64)


class _Timer:
    """Best-of-N wall time of engine.generate on fresh random prompts."""

    def __init__(self, engine: Any, vocab_size: int, repeats: int, seed: int) -> None:
        self.engine, self.vocab_size, self.repeats = engine, vocab_size, repeats
        self.rng = random.Random(seed)

    def generate_s(self, batch_size: int, prompt_tokens: int, new_tokens: int) -> float:
        best_s = float("inf")
        for _ in range(self.repeats):
            ids = [[self.rng.randrange(10, self.vocab_size) for _ in range(prompt_tokens)]
                   for _ in range(batch_size)]
            params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
            start = time.perf_counter()
            self.engine.generate(input_ids=ids, sampling_params=params)
            best_s = min(best_s, time.perf_counter() - start)
        return best_s


def _measure_tables(timer: _Timer, config: MeasureConfig) -> dict[str, Any]:
    timer.generate_s(1, 16, 2)  # warm-up: first calls pay for lazy initialisation
    raw_prefill = [(n, timer.generate_s(1, n, 1)) for n in config.prefill_tokens]
    steps = config.decode_tokens - 1
    raw_steps = [(b, c, max(0.0, timer.generate_s(b, c, config.decode_tokens)
                            - timer.generate_s(b, c, 1)) / steps)
                 for b in config.batch_sizes for c in config.context_tokens]
    prefill_coef = nnls_fit([[1.0, n] for n, _ in raw_prefill], [t for _, t in raw_prefill])
    step_coef = nnls_fit([[1.0, b, b * c] for b, c, _ in raw_steps], [t for *_, t in raw_steps])
    prefill = [(n, prefill_coef[0] + prefill_coef[1] * n) for n in config.prefill_tokens]
    decode = tuple(tuple(step_coef[0] + step_coef[1] * b + step_coef[2] * b * c
                         for c in config.context_tokens) for b in config.batch_sizes)
    return {"prefill": prefill, "decode": decode,
            "raw": json.dumps({"prefill_s": raw_prefill, "step_s": raw_steps})}


def nnls_fit(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Non-negative least squares (scipy), with a floor so no step is ever free."""
    import numpy as np
    from scipy.optimize import nnls

    coef, _ = nnls(np.asarray(rows, dtype=float), np.asarray(targets, dtype=float))
    coef[0] = max(float(coef[0]), 1e-5)
    return [float(c) for c in coef]


def run_measure(config: MeasureConfig) -> Path:
    """Start an engine, measure, write `<out_dir>/<model>--<precision>--<device>.json`."""
    cpu_mode.activate()
    import sglang

    model_dir = ensure_model(config.model, config.cache_dir)
    shape, kv_dtype = read_shape(model_dir)
    weights_bytes, num_params = safetensors_bytes_and_params(model_dir)
    shape = replace(shape, num_params=num_params)
    engine = start_engine(model_path=str(model_dir), **cpu_engine_kwargs({
        "chunked_prefill_size": config.chunk_tokens, "disable_radix_cache": True,
        "log_level": "error", "random_seed": config.seed,
        # Without a cap SGLang sizes the KV pool from free host memory (17 GiB on the 24 GiB
        # dev machine), and the OOM killer took the scheduler when other jobs ran beside it.
        "max_total_tokens": config.max_total_tokens}))
    try:
        tables = _measure_tables(_Timer(engine, shape.vocab_size, config.repeats, config.seed),
                                 config)
    finally:
        shutdown_engine(engine)
    provenance = base_provenance(
        f"python -m fineslab.profile measure --model {config.model}"
        + (" --quick" if config.quick else ""), str(getattr(sglang, "__version__", "?")))
    profile = build_profile(config, shape, kv_dtype, weights_bytes, tables,
                            config.batch_sizes, {**provenance, "raw_timings": tables["raw"]})
    return save_profile(profile, config.out_dir)


def base_provenance(command: str, sglang_version: str) -> dict[str, str]:
    """The provenance every measured profile carries (the caller adds its raw timings)."""
    return {"command": command, "sglang": sglang_version, "host": platform.node() or "?",
            "processor": platform.processor() or platform.machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "activation_bytes": "estimated (roofline formula), not measured"}


def build_profile(config: MeasureConfig, shape: ModelShape, kv_dtype: str, weights_bytes: int,
                  tables: dict[str, Any], batch_sizes: tuple[int, ...],
                  provenance: dict[str, str]) -> ModelProfile:
    """A measured profile from `tables` ("prefill": (tokens, s) points, "decode": seconds per
    batch size of `batch_sizes` per context of `config.context_tokens`)."""
    decode = DecodeTable(batch_sizes, config.context_tokens, tables["decode"])
    workload = config.workload
    throughput = [(b, b / decode.step_s(b, workload.mean_context_tokens))
                  for b in batch_sizes]
    token_bytes = kv_token_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
    kv_per_request = workload.mean_context_tokens * token_bytes
    per_token_act = (4 * shape.hidden_size + 2 * shape.intermediate_size) * 4
    return ModelProfile(
        source="measured", model=config.model, precision=kv_dtype, device=config.device, tp=1,
        kv_dtype=kv_dtype, shape=shape, weights_bytes=weights_bytes, kv_token_bytes=token_bytes,
        device_memory_bytes=_host_memory_bytes(), chunk_tokens=config.chunk_tokens,
        workload=workload,
        activation_bytes=PiecewiseLinear.from_points([
            (b, (config.chunk_tokens + b) * per_token_act + b * shape.vocab_size * 4)
            for b in batch_sizes]),
        prefill_s=PiecewiseLinear.from_points(tables["prefill"]), decode=decode,
        throughput_tokens_per_s=PiecewiseLinear.from_points(throughput),
        mme=PiecewiseLinear.from_points([(0.0, 0.0)] + [
            (b * kv_per_request, tps) for b, tps in throughput]),
        provenance=provenance,
    )


def _host_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)

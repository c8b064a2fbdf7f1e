"""Preparing a model for a precision (fineslab.quant.serving): what the launcher starts a runtime
with, reuse of an earlier preparation, and the checks before a runtime loads it (no SGLang)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from fineslab.env import KV_FORMAT_VAR, KV_SCALES_VAR
from fineslab.errors import ConfigError
from fineslab.quant.serving import PrecisionRuntime, prepare_served_model, verify_runtime
from fineslab.slabs.formats import KVDtype


def test_fp8_on_cpu_serves_dequantized_weights_with_the_fp8_kv_plugin_environment(
        model_cache: Path, tmp_path: Path) -> None:
    src = model_cache / "llama-tiny"
    runtime = prepare_served_model("m", "fp8", "fp8_e4m3", src, tmp_path / "out")
    assert runtime.kv_dtype is KVDtype.FP8_E4M3
    assert "--quantization" not in runtime.server_args, "SGLang's fp8 linear is CUDA-only"
    assert runtime.kv_env[KV_FORMAT_VAR] == "fp8_e4m3"
    assert Path(runtime.kv_env[KV_SCALES_VAR]).is_file()
    verify_runtime(runtime)


def test_a_second_preparation_reuses_the_first_until_the_source_changes(
        model_cache: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in (model_cache / "llama-tiny").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    first = prepare_served_model("a", "awq", "fp16", src, tmp_path / "out")
    written_ns = (first.model_path / "model.safetensors").stat().st_mtime_ns
    again = prepare_served_model("b", "awq", "fp16", src, tmp_path / "out")
    assert again.model_path == first.model_path and again.name == "b"
    assert (again.model_path / "model.safetensors").stat().st_mtime_ns == written_ns, \
        "an unchanged source is not converted again"
    os.utime(src / "model.safetensors", ns=(written_ns + 10**9, written_ns + 10**9))
    changed = prepare_served_model("c", "awq", "fp16", src, tmp_path / "out")
    assert (changed.model_path / "model.safetensors").stat().st_mtime_ns != written_ns, \
        "a changed source is converted again"


def test_a_checkpoint_of_another_quantization_is_refused(model_cache: Path,
                                                         tmp_path: Path) -> None:
    awq = prepare_served_model("a", "awq", "fp16", model_cache / "llama-tiny", tmp_path / "a")
    with pytest.raises(ConfigError, match="is a awq checkpoint; precision fp8 needs"):
        prepare_served_model("f", "fp8", "bf16", awq.model_path, tmp_path / "f")


def test_a_scales_file_missing_a_layer_is_refused_naming_the_file(model_cache: Path,
                                                                  tmp_path: Path) -> None:
    runtime = prepare_served_model("m", "bf16", "fp8_e4m3", model_cache / "llama-tiny",
                                   tmp_path / "out")
    assert runtime.kv_scales_path is not None
    body = json.loads(runtime.kv_scales_path.read_text())
    del body["kv_cache"]["scaling_factor"]["0"]["3"]
    runtime.kv_scales_path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=rf"{runtime.kv_scales_path}: no scale for layer"):
        verify_runtime(runtime)


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _prepare_after_barrier(src: Path, out: Path, start: Barrier,
                           results: Queue[tuple[PrecisionRuntime, list[str]]]) -> None:
    """A launch in a fresh process: prepare `src` as awq into `out` once both processes are
    ready, and report the runtime and this process's preparation log lines."""
    log = logging.getLogger("fineslab.quant.serving")
    handler = _LogLines()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    start.wait(timeout=120)
    runtime = prepare_served_model("m", "awq", "fp16", src, out)
    results.put((runtime, handler.lines))


def test_two_processes_preparing_one_folder_prepare_it_once(model_cache: Path,
                                                            tmp_path: Path) -> None:
    """Regression: two launches preparing the same checkpoint at once both converted it, each
    writing the other's files (a reader could load a half-written safetensors)."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    out = tmp_path / "out"
    procs = [ctx.Process(target=_prepare_after_barrier,
                         args=(model_cache / "llama-tiny", out, start, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "both preparations succeed"
    (first, first_lines), (second, second_lines) = reports
    assert first == second, "both launches get the same runtime"
    lines = first_lines + second_lines
    assert sum(line.startswith("m: preparing") for line in lines) == 1, \
        f"the checkpoint is prepared exactly once: {lines}"
    assert sum(line.startswith("m: reusing") for line in lines) == 1, \
        f"the other launch reuses it: {lines}"
    verify_runtime(first)


def test_kv4_on_gpu_decodes_with_the_plugin_backend(model_cache: Path, tmp_path: Path) -> None:
    """On a GPU a KV4 runtime names the plugin's `fineslab_kv4` backend (torch_native cannot
    serve it fast, triton/flashinfer cannot read the pool) without CUDA graphs; on CPU it keeps
    the CPU flags' torch_native."""
    src = model_cache / "llama-tiny"
    gpu = prepare_served_model("g", "bf16", "int4", src, tmp_path / "g", device="cuda")
    pairs = dict(zip(gpu.server_args[::2], gpu.server_args[1::2], strict=True))
    assert pairs["--attention-backend"] == "fineslab_kv4", gpu.server_args
    assert pairs["--cuda-graph-backend-decode"] == "disabled", "the backend has no CUDA graphs"
    assert gpu.kv_env[KV_FORMAT_VAR] == "int4"
    cpu = prepare_served_model("c", "bf16", "int4", src, tmp_path / "c")
    assert "--attention-backend" not in cpu.server_args, cpu.server_args

"""Serving a model in any precision: the checkpoint, SGLang arguments and KV environment.

What each (weights, KV) choice becomes on each device (docs/precisions.md has the reasons):

    weights    served on CPU                     on GPU
    bf16/fp16  the source checkpoint             same
    fp8        FP8 checkpoint, dequantized to    SGLang `fp8` (W8A8)
               bf16 (SGLang's fp8 linear is
               CUDA-only)
    awq        SGLang `awq` (CPU kernel of       SGLang `awq`/`awq_marlin`
               awq_dequantize in the stand-in)
    qoq        QoQ W4A8 checkpoint, the plugin's `fineslab_qoq` method (picked by SGLang from
               config.json; INT8 activations, INT32 accumulation: torch on CPU, a Triton
               W4A8 GEMM on GPU)

    KV         CPU                               GPU
    bf16/fp16  SGLang's dtype, stock slab pool   same
    fp8_e4m3   FINESLAB_KV_FORMAT=fp8_e4m3 +     SGLang `--kv-cache-dtype fp8_e4m3` with
               FINESLAB_KV_SCALES (plugin pool)  `--quantization-param-path` (calibrated scales)
    int4       FINESLAB_KV_FORMAT=int4 (plugin KV4 pool; on GPU `--attention-backend
               fineslab_kv4`: torch_native with the KV4 Triton decode kernel, no CUDA graphs)

`prepare_served_model` writes what is needed under an output folder (seconds for the tiny
models: weight conversion, and a float32 transformers pass for the FP8 KV scales) and returns a
`PrecisionRuntime`; a `prepared.json` stamp lets the next launch reuse it while the source is
unchanged. Two launches preparing the same folder take turns on `<out_dir>.lock` (an exclusive
`flock`): the second waits, then reuses the first's result through the stamp. `verify_runtime`
checks the result before a runtime loads it. The launcher (`fineslab.launch`) is the one place
that starts runtimes; `fineslab.bench.precision_fleet.run_fleet` is a thin door to it for the
precision tests and the precision benchmark.

What a precision is (its weight format, KV storage, SGLang arguments) is the registry's,
`fineslab.precisions`; this module turns it into files and arguments. The named precisions are
(weights, KV) pairs there: FineServe's four are bf16, fp8, awq and qoq (W4A8KV4); kv4 is QoQ's
KV4 on bf16 weights (KV4's own cost, beside qoq).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fineslab.env import KV_FORMAT_VAR, KV_SCALES_VAR
from fineslab.errors import ConfigError
from fineslab.precisions import (
    AWQ_GROUP_SIZE,
    KV_STORAGE,
    QOQ_GROUP_SIZE,
    WEIGHT_FORMATS,
    WeightFormat,
    config_kv_dtype,
    named_precision,
    weight_format,
)
from fineslab.quant.awq import AWQConfig, write_awq_checkpoint
from fineslab.quant.checkpoint import read_config
from fineslab.quant.fp8 import (
    KV_SCALES_FILE,
    calibrate_kv_scales,
    dequantize_fp8_checkpoint,
    load_kv_scales,
    write_fp8_checkpoint,
    write_kv_scales,
)
from fineslab.quant.kv4 import KV4_ATTENTION_BACKEND
from fineslab.quant.qoq_checkpoint import write_qoq_checkpoint
from fineslab.quant.verify import config_int, verify_checkpoint
from fineslab.slabs.formats import KVDtype, KVShape

logger = logging.getLogger(__name__)

#: Calibration token ids for the FP8 KV scales (a fixed, model-agnostic prompt of small ids).
CALIBRATION_IDS = (tuple(range(3, 131)), tuple(range(200, 264)))
STAMP_FILE = "prepared.json"
LOCK_SUFFIX = ".lock"


@dataclass(frozen=True)
class PrecisionRuntime:
    """One model ready to serve: what to start and what its KV looks like."""

    name: str
    precision: str  # a named precision (bf16, fp8, awq, kv4) or "<weights>+<kv>"
    model_path: Path
    kv_dtype: KVDtype
    server_args: tuple[str, ...]
    kv_env: dict[str, str] = field(default_factory=dict)
    source_dir: Path | None = None
    kv_scales_path: Path | None = None

    def kv_shape(self) -> KVShape:
        return KVShape.from_hf_config(read_config(self.model_path), self.name, self.kv_dtype)


def served_dir_name(src_dir: Path, weights: str, kv: str, device: str) -> str:
    """The folder, under a prepared-models folder, of `src_dir` served as (weights, kv)."""
    return f"{src_dir.name}--{weights}--{kv}--{'cpu' if device == 'cpu' else 'gpu'}"


def describe_serving(weights: str, kv: str, device: str) -> str:
    """One line for people: what the runtime actually runs (the --dry-run table)."""
    cpu = device == "cpu"
    parts = {"fp8": "fp8 ckpt, dequantized to bf16" if cpu else "fp8 ckpt (W8A8)",
             "awq": f"awq ckpt (W4A16, group {AWQ_GROUP_SIZE})",
             "qoq": f"qoq ckpt (W4A8, group {QOQ_GROUP_SIZE})"}.get(weights, "source ckpt")
    dtype = config_kv_dtype(kv)
    label = {KVDtype.INT4: "KV4", KVDtype.FP8_E4M3: "fp8 KV"}.get(dtype)
    if KV_STORAGE[dtype].plugin_pool(cpu):
        parts += f" + {label} plugin pool"
    elif label is not None:
        parts += f" + SGLang {label}"
    return parts


# --- preparing ---------------------------------------------------------------------------------

def _source_stamp(src_dir: Path, weights: str, kv: str, device: str) -> dict[str, Any]:
    files = sorted([src_dir / "config.json", *src_dir.glob("*.safetensors")])
    return {"source": str(src_dir.resolve()), "weights": weights, "kv": kv,
            "device": "cpu" if device == "cpu" else "gpu",
            "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def _stamped(out_dir: Path, stamp: dict[str, Any]) -> PrecisionRuntime | None:
    try:
        body = json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    if body.get("stamp") != stamp:
        return None
    r = body["runtime"]
    scales = r["kv_scales_path"]
    if not Path(r["model_path"]).is_dir() or (scales and not Path(scales).is_file()):
        return None  # removed since: prepare again
    return PrecisionRuntime(r["name"], r["precision"], Path(r["model_path"]),
                            KVDtype(r["kv_dtype"]), tuple(r["server_args"]), dict(r["kv_env"]),
                            Path(r["source_dir"]), Path(scales) if scales else None)


def _write_stamp(out_dir: Path, stamp: dict[str, Any], runtime: PrecisionRuntime) -> None:
    body = asdict(runtime)
    body.update(model_path=str(runtime.model_path), kv_dtype=runtime.kv_dtype.value,
                source_dir=str(runtime.source_dir), server_args=list(runtime.server_args),
                kv_scales_path=str(runtime.kv_scales_path) if runtime.kv_scales_path else None)
    tmp = out_dir / f".{STAMP_FILE}.tmp"
    tmp.write_text(json.dumps({"stamp": stamp, "runtime": body}, indent=2) + "\n")
    tmp.rename(out_dir / STAMP_FILE)


def _prepare_weights(fmt: WeightFormat, src_dir: Path, out_dir: Path, cpu: bool
                     ) -> tuple[Path, tuple[str, ...]]:
    """The checkpoint to serve and its SGLang weight arguments (`--dtype`, `--quantization`)."""
    method = verify_checkpoint(src_dir)
    if method is not None and method != fmt.quant_method:
        raise ConfigError(f"{src_dir} is a {method} checkpoint; precision {fmt.name} needs an "
                          f"unquantized source or a {fmt.name} checkpoint")
    quantization = fmt.quantization_arg(cpu)
    args = ("--dtype", fmt.torch_dtype, *(("--quantization", quantization) if quantization
                                          else ()))
    if fmt.quant_method is None or method == fmt.quant_method:
        path = src_dir
    elif fmt.name == "qoq":
        path = write_qoq_checkpoint(src_dir, out_dir / "qoq", group_size=QOQ_GROUP_SIZE)
    elif fmt.name == "awq":
        path = write_awq_checkpoint(src_dir, out_dir / "awq", AWQConfig(group_size=AWQ_GROUP_SIZE))
    else:
        path = write_fp8_checkpoint(src_dir, out_dir / "fp8")
    if fmt.name == "fp8" and quantization is None:  # CPU: SGLang's fp8 linear is CUDA-only
        path = dequantize_fp8_checkpoint(path, out_dir / "fp8-as-bf16")
    return path, args


def _prepare_kv(kv: KVDtype, src_dir: Path, out_dir: Path, cpu: bool
                ) -> tuple[tuple[str, ...], dict[str, str], Path | None]:
    """SGLang KV arguments, the plugin's KV environment, and the FP8 scales file if any."""
    storage = KV_STORAGE[kv]
    env = {KV_FORMAT_VAR: kv.config_name} if storage.plugin_pool(cpu) else {}
    args: tuple[str, ...] = ()
    if kv is KVDtype.INT4 and not cpu:
        # Kv4SlabKVPool hands out Kv4Readers, which triton/flashinfer cannot read: the plugin's
        # backend decodes with the KV4 Triton kernel (prefill stays torch_native's). It has no
        # CUDA graph support; flags as (name, value) pairs, which verify_runtime reads.
        args = ("--attention-backend", KV4_ATTENTION_BACKEND,
                "--cuda-graph-backend-decode", "disabled",
                "--cuda-graph-backend-prefill", "disabled")
    if not storage.needs_scales:
        return args, env, None
    scales = calibrate_kv_scales(src_dir, CALIBRATION_IDS)
    model_type = str(read_config(src_dir).get("model_type", ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    scales_file = write_kv_scales(out_dir / KV_SCALES_FILE, scales, model_type)
    if env:  # the plugin's pool stores it (CPU: SGLang's FP8 KV needs Intel AMX kernels)
        return args, {**env, KV_SCALES_VAR: str(scales_file)}, scales_file
    return ((*args, "--kv-cache-dtype", kv.value, "--quantization-param-path", str(scales_file)),
            env, scales_file)


@contextmanager
def _preparation_lock(out_dir: Path, name: str) -> Iterator[None]:
    """Hold `<out_dir>.lock` exclusively: one process at a time checks the stamp and prepares.

    Beside `out_dir`, not in it, so a preparation may replace the folder's contents. The lock
    file stays (removing it would race with a process about to lock it); the kernel drops the
    lock when its holder exits, crashed or not. The waiter loses at most the other process's
    preparation time, which it would otherwise have spent converting the same checkpoint.
    """
    lock_path = out_dir.with_name(out_dir.name + LOCK_SUFFIX)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s: waiting for another process preparing the same checkpoint in %s",
                        name, out_dir)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_served_model(name: str, weights: str, kv: str, src_dir: Path, out_dir: Path, *,
                         device: str = "cpu", precision: str | None = None) -> PrecisionRuntime:
    """Checkpoint, SGLang arguments and KV environment for serving `src_dir` with `weights`
    precision and `kv` KV storage on `device`; reuses `out_dir`'s earlier result when its stamp
    matches. ConfigError on a bad or mismatched source checkpoint."""
    kv_dtype = config_kv_dtype(kv)
    fmt = weight_format(weights)
    src_dir = Path(src_dir)
    stamp = _source_stamp(src_dir, weights, kv, device)
    with _preparation_lock(out_dir, name):
        cached = _stamped(out_dir, stamp)
        if cached is not None:
            logger.info("%s: reusing the prepared checkpoint in %s", name, out_dir)
            return dataclasses.replace(cached, name=name, precision=precision or cached.precision)
        logger.info("%s: preparing %s weights and %s KV in %s", name, weights, kv, out_dir)
        # No stamp while the folder is rewritten: a crash leaves it unstamped, not stale.
        (out_dir / STAMP_FILE).unlink(missing_ok=True)
        cpu = device == "cpu"
        path, weight_args = _prepare_weights(fmt, src_dir, out_dir, cpu)
        kv_args, kv_env, scales = _prepare_kv(kv_dtype, src_dir, out_dir, cpu)
        runtime = PrecisionRuntime(name, precision or f"{weights}+{kv}", path, kv_dtype,
                                   (*weight_args, *kv_args), kv_env, src_dir, scales)
        if out_dir.exists():
            _write_stamp(out_dir, stamp, runtime)  # last, by rename: a stamp means complete
        return runtime


def verify_runtime(runtime: PrecisionRuntime) -> None:
    """Check the served checkpoint and the FP8 KV scales file before a runtime loads them;
    ConfigError naming the file and every problem."""
    method = verify_checkpoint(runtime.model_path)
    quantization = dict(zip(runtime.server_args[::2], runtime.server_args[1::2],
                            strict=False)).get("--quantization")
    picked = [w.quant_method for w in WEIGHT_FORMATS.values() if w.picked_from_config]
    if method != quantization and not (quantization is None and method in picked):
        raise ConfigError(f"{runtime.name}: {runtime.model_path} is "
                          f"{f'a {method}' if method else 'an unquantized'} checkpoint, but the "
                          f"runtime would load it with --quantization {quantization}")
    if runtime.kv_scales_path is not None:
        num_layers = config_int(read_config(runtime.model_path), "num_hidden_layers")
        load_kv_scales(runtime.kv_scales_path, num_layers)


def prepare_runtime(precision: str, src_dir: Path, work_dir: Path, *,
                    device: str = "cpu", name: str | None = None) -> PrecisionRuntime:
    """`prepare_served_model` for one of the named precisions (`fineslab.precisions`)."""
    named = named_precision(precision)
    weights, kv = named.weights.name, named.kv.config_name
    out = work_dir / served_dir_name(src_dir, weights, kv, device)
    return prepare_served_model(name or f"{src_dir.name}-{precision}", weights, kv, src_dir, out,
                                device=device, precision=precision)

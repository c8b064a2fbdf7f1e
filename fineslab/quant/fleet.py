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
               config.json; plain torch: INT8 activations, INT32 accumulation; no GPU kernel)

    KV         CPU                               GPU
    bf16/fp16  SGLang's dtype, stock slab pool   same
    fp8_e4m3   FINESLAB_KV_FORMAT=fp8_e4m3 +     SGLang `--kv-cache-dtype fp8_e4m3` with
               FINESLAB_KV_SCALES (plugin pool)  `--quantization-param-path` (calibrated scales)
    int4       FINESLAB_KV_FORMAT=int4 (plugin KV4 pool; torch_native attention on GPU too)

`prepare_served_model` writes what is needed under an output folder (seconds for the tiny
models: weight conversion, and a float32 transformers pass for the FP8 KV scales) and returns a
`PrecisionRuntime`; a `prepared.json` stamp lets the next launch reuse it while the source is
unchanged. Two launches preparing the same folder take turns on `<out_dir>.lock` (an exclusive
`flock`): the second waits, then reuses the first's result through the stamp. `verify_runtime`
checks the result before a runtime loads it. The launcher (`fineslab.launch`) is the one place
that starts runtimes; `run_fleet` below is a thin door to it for the precision tests and the
precision benchmark.

The named precisions are (weights, KV) pairs: `NAMED_PRECISIONS`; FineServe's four are bf16,
fp8, awq and qoq (W4A8KV4); kv4 is QoQ's KV4 on bf16 weights (what the mixed fleet ran before
the W4A8 method existed, kept beside it: KV4's own cost).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fineslab.env import KV_FORMAT_VAR, KV_SCALES_VAR
from fineslab.errors import ConfigError
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
from fineslab.quant.qoq_checkpoint import QUANT_METHOD as QOQ_METHOD
from fineslab.quant.qoq_checkpoint import write_qoq_checkpoint
from fineslab.quant.verify import config_int, verify_checkpoint
from fineslab.slabs import BlockFormat, SlabArena
from fineslab.slabs.formats import KVDtype, KVShape

logger = logging.getLogger(__name__)

#: FineServe's four precisions as (weights, KV dtype) in the launcher's terms.
NAMED_PRECISIONS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8_e4m3"),
                    "awq": ("awq", "fp16"), "kv4": ("bf16", "int4"), "qoq": ("qoq", "int4")}
#: The mixed fleet of the precision tests and benchmark (kv4 and qoq both: KV4 alone, then
#: with W4A8 weights).
PRECISIONS = tuple(NAMED_PRECISIONS)
#: The KV dtype names of the fleet config -> the arena's storage type.
KV_DTYPES = {"bf16": KVDtype.BF16, "fp16": KVDtype.FP16, "fp8_e4m3": KVDtype.FP8_E4M3,
             "int4": KVDtype.INT4}
_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16", "awq": "float16",
                "qoq": "bfloat16"}
#: The checkpoint's quant_method of each quantized weight precision.
QUANT_METHODS = {"fp8": "fp8", "awq": "awq", "qoq": QOQ_METHOD}
#: Methods SGLang picks from config.json alone: the runtime gets no `--quantization` (a plugin
#: method is not among the flag's choices when SGLang parses its arguments).
PICKED_FROM_CONFIG = (QOQ_METHOD,)
AWQ_GROUP_SIZE = 64
QOQ_GROUP_SIZE = 128
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
        return model_kv_shape(self.model_path, self.name, self.kv_dtype)


def model_kv_shape(model_dir: Path, name: str, kv_dtype: KVDtype) -> KVShape:
    """The KV geometry of the model in `model_dir` (from config.json) stored as `kv_dtype`."""
    config = read_config(model_dir)
    heads = config_int(config, "num_attention_heads")
    hidden = config_int(config, "hidden_size")
    head_dim = config_int(config, "head_dim") if config.get("head_dim") else hidden // heads
    return KVShape(name, config_int(config, "num_hidden_layers"),
                   config_int(config, "num_key_value_heads", heads), head_dim, kv_dtype)


def served_dir_name(src_dir: Path, weights: str, kv: str, device: str) -> str:
    """The folder, under a prepared-models folder, of `src_dir` served as (weights, kv)."""
    return f"{src_dir.name}--{weights}--{kv}--{'cpu' if device == 'cpu' else 'gpu'}"


def describe_serving(weights: str, kv: str, device: str) -> str:
    """One line for people: what the runtime actually runs (the --dry-run table)."""
    cpu = device == "cpu"
    parts = {"fp8": "fp8 ckpt, dequantized to bf16" if cpu else "fp8 ckpt (W8A8)",
             "awq": f"awq ckpt (W4A16, group {AWQ_GROUP_SIZE})",
             "qoq": f"qoq ckpt (W4A8, group {QOQ_GROUP_SIZE})"}.get(weights, "source ckpt")
    if kv == "int4":
        parts += " + KV4 plugin pool"
    elif kv == "fp8_e4m3":
        parts += " + fp8 KV plugin pool" if cpu else " + SGLang fp8 KV"
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


def _prepare_weights(weights: str, src_dir: Path, out_dir: Path, cpu: bool
                     ) -> tuple[Path, tuple[str, ...]]:
    """The checkpoint to serve and its SGLang weight arguments."""
    method = verify_checkpoint(src_dir)
    dtype = ("--dtype", _TORCH_DTYPE[weights])
    if method is not None and method != QUANT_METHODS.get(weights):
        raise ConfigError(f"{src_dir} is a {method} checkpoint; precision {weights} needs an "
                          f"unquantized source or a {weights} checkpoint")
    if weights in ("bf16", "fp16"):
        return src_dir, dtype
    if weights == "qoq":
        path = src_dir if method == QOQ_METHOD else write_qoq_checkpoint(
            src_dir, out_dir / "qoq", group_size=QOQ_GROUP_SIZE)
        return path, dtype
    if weights == "awq":
        path = src_dir if method == "awq" else write_awq_checkpoint(
            src_dir, out_dir / "awq", AWQConfig(group_size=AWQ_GROUP_SIZE))
        return path, (*dtype, "--quantization", "awq")
    fp8 = src_dir if method == "fp8" else write_fp8_checkpoint(src_dir, out_dir / "fp8")
    if not cpu:
        return fp8, (*dtype, "--quantization", "fp8")
    return dequantize_fp8_checkpoint(fp8, out_dir / "fp8-as-bf16"), dtype


def _prepare_kv(kv: str, src_dir: Path, out_dir: Path, cpu: bool
                ) -> tuple[tuple[str, ...], dict[str, str], Path | None]:
    """SGLang KV arguments, the plugin's KV environment, and the FP8 scales file if any."""
    if kv == "int4":
        # Kv4SlabKVPool is read by torch_native only (a GPU KV4 backend is future work).
        return (() if cpu else ("--attention-backend", "torch_native"),
                {KV_FORMAT_VAR: "int4"}, None)
    if kv != "fp8_e4m3":
        return (), {}, None
    scales = calibrate_kv_scales(src_dir, CALIBRATION_IDS)
    model_type = str(read_config(src_dir).get("model_type", ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    scales_file = write_kv_scales(out_dir / KV_SCALES_FILE, scales, model_type)
    if cpu:  # SGLang's FP8 KV needs Intel AMX kernels on CPU: the plugin's pool stores it
        return (), {KV_FORMAT_VAR: "fp8_e4m3", KV_SCALES_VAR: str(scales_file)}, scales_file
    return (("--kv-cache-dtype", "fp8_e4m3", "--quantization-param-path", str(scales_file)),
            {}, scales_file)


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
    if kv not in KV_DTYPES:
        raise ConfigError(f"kv dtype {kv!r}: expected one of {sorted(KV_DTYPES)}")
    if weights not in _TORCH_DTYPE:
        raise ConfigError(f"precision {weights!r}: expected one of {sorted(_TORCH_DTYPE)}")
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
        path, weight_args = _prepare_weights(weights, src_dir, out_dir, cpu)
        kv_args, kv_env, scales = _prepare_kv(kv, src_dir, out_dir, cpu)
        runtime = PrecisionRuntime(name, precision or f"{weights}+{kv}", path, KV_DTYPES[kv],
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
    if method != quantization and not (quantization is None and method in PICKED_FROM_CONFIG):
        raise ConfigError(f"{runtime.name}: {runtime.model_path} is "
                          f"{f'a {method}' if method else 'an unquantized'} checkpoint, but the "
                          f"runtime would load it with --quantization {quantization}")
    if runtime.kv_scales_path is not None:
        num_layers = config_int(read_config(runtime.model_path), "num_hidden_layers")
        load_kv_scales(runtime.kv_scales_path, num_layers)


def prepare_runtime(precision: str, src_dir: Path, work_dir: Path, *,
                    device: str = "cpu", name: str | None = None) -> PrecisionRuntime:
    """`prepare_served_model` for one of the named precisions (`NAMED_PRECISIONS`)."""
    if precision not in NAMED_PRECISIONS:
        raise ConfigError(f"precision {precision!r}: expected one of {PRECISIONS}")
    weights, kv = NAMED_PRECISIONS[precision]
    out = work_dir / served_dir_name(src_dir, weights, kv, device)
    return prepare_served_model(name or f"{src_dir.name}-{precision}", weights, kv, src_dir, out,
                                device=device, precision=precision)


# --- the four precisions in one arena, through the launcher ------------------------------------

@dataclass
class FleetMember:
    """A started runtime of the fleet, its server URL and its block format in the arena."""

    runtime: PrecisionRuntime
    runtime_id: str
    base_url: str
    fmt: BlockFormat

    def generate(self, payload: Mapping[str, object], timeout_s: float = 600.0) -> Any:
        """POST `payload` to the runtime's `/generate` and return the decoded JSON."""
        request = urllib.request.Request(self.base_url + "/generate",
                                         json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())


@dataclass
class RunningFleet:
    arena: SlabArena
    members: dict[str, FleetMember]  # by named precision
    router_url: str


def _fleet_dict(runtimes: list[PrecisionRuntime], fleet_id: str, arena_bytes: int, cpu: bool,
                extra_args: tuple[str, ...], extra_env: Mapping[str, str],
                max_running_requests: int) -> dict[str, Any]:
    """A launcher fleet config serving each prepared runtime's source in its precision."""
    device: dict[str, Any] = {"name": "cpu", "kind": "cpu", "memory_gib": 8}
    if not cpu:
        import torch

        from fineslab.launch.plan import gpu_kind

        props = torch.cuda.get_device_properties(0)
        device = {"name": "cuda:0", "kind": gpu_kind(props.name),
                  "memory_gib": props.total_memory / (1 << 30)}
    models = []
    for r in runtimes:
        if r.source_dir is None or r.precision not in NAMED_PRECISIONS:
            raise ConfigError(f"{r.name}: run_fleet takes runtimes from prepare_runtime")
        weights, kv = NAMED_PRECISIONS[r.precision]
        models.append({"name": r.name, "path": str(r.source_dir), "precision": weights,
                       "kv_dtype": kv, "ttft_slo_s": 60.0, "request_rate_per_s": 0.1,
                       "extra_args": list(extra_args), "env": dict(extra_env)})
    return {"fleet_id": fleet_id, "devices": [dict(device, kv_arena_mib=arena_bytes / (1 << 20))],
            "kv_pool": "arena", "router": {"port": 0,
                                           "max_running_requests": max_running_requests},
            "models": models}


@contextmanager
def run_fleet(runtimes: list[PrecisionRuntime], work_dir: Path, fleet_id: str, *,
              arena_bytes: int, page_size_tokens: int = 16, cpu: bool = True,
              extra_args: tuple[str, ...] = (), extra_env: Mapping[str, str] | None = None,
              max_running_requests: int = 8) -> Iterator[RunningFleet]:
    """Start `runtimes` (from `prepare_runtime`) in one arena with the launcher's `Fleet`, yield
    when all are healthy, stop everything (runtimes, router, arena) on exit.

    The launcher finds the checkpoints `prepare_runtime` wrote under `work_dir` by their stamps
    and reuses them. On a GPU the launcher needs a profile of the model for that GPU kind
    (`python -m fineslab.profile`), as any GPU fleet does.
    """
    # The launcher imports this module; imported here, not at the top.
    from fineslab.launch.config import fleet_from_dict
    from fineslab.launch.fleet import Fleet
    from fineslab.launch.plan import make_plan
    from fineslab.runtime import free_port

    data = _fleet_dict(runtimes, fleet_id, arena_bytes, cpu, extra_args, extra_env or {},
                       max_running_requests)
    plan = make_plan(fleet_from_dict(data, f"<run_fleet {fleet_id}>"), prepared_dir=work_dir,
                     page_sizes=(page_size_tokens,))
    with Fleet(plan, port=free_port(), log_dir=str(work_dir / "logs")) as fleet:
        by_name = {r.name: r for r in runtimes}
        members = {}
        for r in plan.runtimes:
            runtime = dataclasses.replace(fleet.prepared[r.model.name],
                                          precision=by_name[r.model.name].precision)
            members[runtime.precision] = FleetMember(
                runtime, r.runtime_id, fleet.runtime_url(r.runtime_id),
                plan.arenas[0].slab_plan.format_of(r.runtime_id))
        yield RunningFleet(fleet.arenas[plan.arenas[0].device.name], members, fleet.base_url)

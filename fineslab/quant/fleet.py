"""One model in four precisions, ready to serve side by side in one slab arena.

What each precision is on each device (docs/precisions.md has the reasons):

    precision  weights served on CPU            on GPU                    KV storage
    bf16       bf16 checkpoint                  same                      bf16
    fp8        FP8 checkpoint, dequantized to   SGLang `fp8` (W8A8)       FP8 e4m3, per-layer
               bf16 (SGLang's fp8 linear is                               scales (scales file)
               CUDA-only)
    awq        SGLang `awq` (CPU kernel of      SGLang `awq`/`awq_marlin` fp16
               awq_dequantize in the stand-in)
    kv4        bf16 (W4A8 GEMMs are SGLang      SGLang `qoq` (W4A8)       INT4 + per-token
               `qoq`, CUDA-only)                                          per-head scale/zero

`prepare_runtime` writes the checkpoints and the FP8 scales file under a work folder (seconds
for the tiny models) and returns what a launcher needs: model path, SGLang arguments, the
environment (arena join + quantized KV format) and the KV geometry for the slab plan.

Until pyproject.toml declares the `fineslab_quant` entry point, `plugin_shim` writes a tiny
`.dist-info` that declares it; put its folder on the runtimes' PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fineslab.cpu_mode import child_environ
from fineslab.errors import ConfigError
from fineslab.quant.awq import AWQConfig, write_awq_checkpoint
from fineslab.quant.checkpoint import read_config
from fineslab.quant.fp8 import (
    KV_SCALES_FILE,
    calibrate_kv_scales,
    dequantize_fp8_checkpoint,
    write_fp8_checkpoint,
    write_kv_scales,
)
from fineslab.quant.verify import config_int
from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.slabs import ArenaSpec, BlockFormat, SlabArena, plan_slabs
from fineslab.slabs.formats import KVDtype, KVShape

PRECISIONS = ("bf16", "fp8", "awq", "kv4")
PLUGIN_NAME = "fineslab_quant"
PLUGIN_ENTRY = "fineslab.sglang_plugin.quant_session:register"
#: Calibration token ids for the FP8 KV scales (a fixed, model-agnostic prompt of small ids).
CALIBRATION_IDS = (tuple(range(3, 131)), tuple(range(200, 264)))


@dataclass(frozen=True)
class PrecisionRuntime:
    """One runtime of the mixed fleet: what to start and what its KV looks like."""

    name: str
    precision: str
    model_path: Path
    kv_dtype: KVDtype
    server_args: tuple[str, ...]
    kv_env: dict[str, str] = field(default_factory=dict)

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


def prepare_runtime(precision: str, src_dir: Path, work_dir: Path, *,
                    device: str = "cpu", name: str | None = None) -> PrecisionRuntime:
    """Checkpoints, arguments and KV environment for serving `src_dir` in `precision`."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: expected one of {PRECISIONS}")
    name = name or f"{src_dir.name}-{precision}"
    out = work_dir / name
    cpu = device == "cpu"
    if precision == "bf16":
        return PrecisionRuntime(name, precision, src_dir, KVDtype.BF16, ("--dtype", "bfloat16"))
    if precision == "awq":
        path = write_awq_checkpoint(src_dir, out, AWQConfig(group_size=64))
        return PrecisionRuntime(name, precision, path, KVDtype.FP16,
                                ("--dtype", "float16", "--quantization", "awq"))
    if precision == "kv4":
        # Kv4SlabKVPool is read by torch_native only (a GPU KV4 backend is future work).
        args = ("--dtype", "bfloat16") if cpu else (
            "--dtype", "bfloat16", "--attention-backend", "torch_native")
        return PrecisionRuntime(name, precision, src_dir, KVDtype.INT4, args,
                                {"FINESLAB_KV_FORMAT": "int4"})
    fp8 = write_fp8_checkpoint(src_dir, out.with_name(name + "-ckpt"))
    scales = calibrate_kv_scales(src_dir, CALIBRATION_IDS)
    model_type = str(read_config(src_dir).get("model_type", ""))
    if not cpu:
        scales_file = write_kv_scales(fp8 / KV_SCALES_FILE, scales, model_type)
        return PrecisionRuntime(name, precision, fp8, KVDtype.FP8_E4M3, (
            "--dtype", "bfloat16", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3",
            "--quantization-param-path", str(scales_file)))
    served = dequantize_fp8_checkpoint(fp8, out)
    scales_file = write_kv_scales(served / KV_SCALES_FILE, scales, model_type)
    return PrecisionRuntime(name, precision, served, KVDtype.FP8_E4M3, ("--dtype", "bfloat16"),
                            {"FINESLAB_KV_FORMAT": "fp8_e4m3",
                             "FINESLAB_KV_SCALES": str(scales_file)})


def plugin_shim(folder: Path) -> Path:
    """A folder whose `.dist-info` declares the `fineslab_quant` SGLang plugin entry point."""
    dist = folder / "fineslab_quant_plugin-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fineslab-quant-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[sglang.srt.plugins]\n{PLUGIN_NAME} = {PLUGIN_ENTRY}\n")
    return folder


def runtime_environ(runtime: PrecisionRuntime, arena_name: str, shim: Path,
                    cpu: bool = True) -> dict[str, str]:
    """The full environment of one fleet runtime's SGLang process."""
    env = child_environ() if cpu else dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(shim)])
    env.update({"FINESLAB_ARENA": arena_name, "FINESLAB_RUNTIME_ID": runtime.name,
                "SGLANG_PLUGINS": PLUGIN_NAME, **runtime.kv_env})
    return env


def describe(runtimes: list[PrecisionRuntime]) -> str:
    return json.dumps([{"name": r.name, "precision": r.precision, "kv": r.kv_dtype.value,
                        "model": str(r.model_path)} for r in runtimes], indent=2)


@dataclass
class FleetMember:
    """A started runtime of the fleet, its server and its block format in the arena."""

    runtime: PrecisionRuntime
    server: ServerProcess
    fmt: BlockFormat

    def generate(self, payload: Mapping[str, object], timeout_s: float = 600.0) -> Any:
        """POST `payload` to the runtime's `/generate` and return the decoded JSON."""
        request = urllib.request.Request(self.server.spec.base_url + "/generate",
                                         json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())


@dataclass
class RunningFleet:
    arena: SlabArena
    members: dict[str, FleetMember]


@contextmanager
def run_fleet(runtimes: list[PrecisionRuntime], work_dir: Path, fleet_id: str, *,
              arena_bytes: int, page_size_tokens: int = 16, cpu: bool = True,
              extra_args: tuple[str, ...] = (), extra_env: Mapping[str, str] | None = None,
              start_timeout_s: float = 420.0) -> Iterator[RunningFleet]:
    """Plan one arena for `runtimes`, create it, start every runtime in it (in parallel),
    yield when all are healthy; stop them and close the arena on exit."""
    plan = plan_slabs([r.kv_shape() for r in runtimes], page_sizes=(page_size_tokens,))
    device = "cpu0" if cpu else "cuda:0"
    spec = ArenaSpec.fit(fleet_id, device, arena_bytes, plan.slab_bytes, list(plan.formats))
    shim = plugin_shim(work_dir / "shim")
    arena = SlabArena.create(spec)
    members: dict[str, FleetMember] = {}
    try:
        for r in runtimes:
            args = (*r.server_args, "--page-size", str(page_size_tokens), *extra_args)
            env = {**runtime_environ(r, fleet_id, shim, cpu), **(extra_env or {})}
            server_spec = ServerSpec(str(r.model_path), free_port(), cpu=cpu,
                                     extra_args=args, env=env)
            members[r.precision] = FleetMember(
                r, ServerProcess(server_spec, work_dir / f"{r.name}.log"), plan.format_of(r.name))
        for member in members.values():
            member.server.wait_healthy(start_timeout_s)
        yield RunningFleet(arena, members)
    finally:
        for member in members.values():
            member.server.stop()
        arena.close()

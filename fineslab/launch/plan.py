"""From a fleet config to a fleet plan: devices, profiles, the global placer, arenas, runtimes.

    config --resolve_devices--> devices --find_profile--> demands --placer--> PlacementPlan
           --plan_arenas--> one SlabPlan + arena size per device
           --> RuntimePlan per model replica: device, runtime id, SGLang page size and flags

Nothing here starts a process or touches shared memory, so `--dry-run` is `make_plan` + print.
Arena size per device: `kv_arena_mib` from the config, else 90% of what the placement leaves
after the fixed footprints F_M (weights, activations, base KV) of the replicas on it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fineslab import cpu_mode
from fineslab.bench.report import format_table
from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError, PlacementInfeasible
from fineslab.launch.config import (
    AUTO_CPU_ARENA_BYTES,
    AUTO_CPU_MEMORY_FRACTION,
    DeviceConfig,
    FleetConfig,
    ModelConfig,
)
from fineslab.launch.profiles import find_profile, profile_dirs
from fineslab.models.generate import ensure_model
from fineslab.scheduler.placement import GpuSpec, ModelDemand, PlacementPlan, get_placement_policy
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.slabs import KVDtype, KVShape, SlabPlan, plan_slabs

logger = logging.getLogger(__name__)

MIB = float(1 << 20)
ARENA_FRACTION_OF_FREE = 0.9
_SLAB_KV_DTYPES = {"bf16": KVDtype.BF16, "fp16": KVDtype.FP16, "fp8_e4m3": KVDtype.FP8_E4M3}


@dataclass(frozen=True)
class RuntimePlan:
    """One SGLang runtime to start: a replica of a model on one device."""

    runtime_id: str
    model: ModelConfig
    model_dir: str
    replica: int
    device: DeviceConfig
    page_size: int | None  # the arena block's tokens; None on SGLang's own pool


@dataclass(frozen=True)
class ArenaPlan:
    device: DeviceConfig
    slab_plan: SlabPlan
    arena_bytes: int


@dataclass(frozen=True)
class FleetPlan:
    config: FleetConfig
    devices: tuple[DeviceConfig, ...]
    profiles: dict[str, ModelProfile]
    placement: PlacementPlan
    arenas: tuple[ArenaPlan, ...]
    runtimes: tuple[RuntimePlan, ...]

    def runtimes_of(self, model: str) -> list[RuntimePlan]:
        return [r for r in self.runtimes if r.model.name == model]

    def describe(self) -> str:
        """The placement table, the arenas and the runtimes, for people."""
        text = [self.placement.table(), ""]
        rows = [[a.device.name, a.arena_bytes / MIB, a.slab_plan.slab_bytes / MIB,
                 a.arena_bytes // a.slab_plan.slab_bytes, f"{a.slab_plan.worst_padding_waste:.2%}"]
                for a in self.arenas]
        if rows:
            text += ["arenas", format_table(
                ["device", "arena_MiB", "slab_MiB", "slabs", "worst_padding"], rows), ""]
        rows = [[r.runtime_id, r.model.name, r.device.name, r.model.precision,
                 r.model.resolved_kv_dtype, r.page_size or "-",
                 f"{self.profiles[r.model.name].source}", r.model_dir] for r in self.runtimes]
        text += ["runtimes", format_table(
            ["runtime", "model", "device", "precision", "kv", "page", "profile", "path"], rows)]
        return "\n".join(text)


def arena_device(device: DeviceConfig) -> str:
    """The device name the arena is created under: the SGLang plugin attaches
    `f"{device}:{gpu_id}"`, which is "cpu:0" for a CPU runtime (shm files `...-cpu0.*`)."""
    return "cpu:0" if device.name == "cpu" else device.name


def resolve_devices(config: FleetConfig) -> tuple[DeviceConfig, ...]:
    """The configured devices, or for "auto" the CUDA GPUs, else one CPU device."""
    if config.devices is not None:
        return config.devices
    if cpu_mode.is_cpu_mode():
        import psutil

        memory = int(psutil.virtual_memory().total * AUTO_CPU_MEMORY_FRACTION)
        return (DeviceConfig("cpu", "cpu", memory, AUTO_CPU_ARENA_BYTES),)
    import torch

    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        kind = next((k for k in ("h200", "h100", "a100") if k in props.name.lower()),
                    props.name.lower().replace(" ", "-"))
        devices.append(DeviceConfig(f"cuda:{i}", kind, int(props.total_memory), None))
    return tuple(devices)


def model_dir_of(model: ModelConfig, cache_dir: str | None = None) -> Path:
    """The model folder: `path` as given, or the preset generated into the model cache."""
    if model.model_path is not None:
        path = Path(model.model_path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model {model.name}: {path} has no config.json")
        return path
    assert model.preset is not None  # the config guarantees one of them
    return ensure_model(model.preset, cache_dir or FineslabEnv.from_environ().model_cache_dir)


def check_device_support(model: ModelConfig, device: DeviceConfig) -> None:
    if not device.is_cpu:
        return
    if model.precision in ("fp8", "awq"):
        raise ConfigError(f"model {model.name}: {model.precision} weights need a GPU; on CPU "
                          "use precision bf16 or fp16")
    if model.resolved_kv_dtype == "fp8_e4m3":
        import torch

        if not torch._C._cpu._is_amx_tile_supported():  # type: ignore[attr-defined]
            raise ConfigError(f"model {model.name}: SGLang 0.5.23 keeps FP8 KV on CPU only with "
                              "Intel AMX, which this CPU lacks; use kv_dtype bf16 or fp16")


def _demands(config: FleetConfig, profiles: dict[str, ModelProfile]) -> list[ModelDemand]:
    demands = []
    for m in config.models:
        copies = m.replicas or 1
        for i in range(copies):
            name = m.name if m.replicas is None else f"{m.name}#{i}"
            demands.append(ModelDemand(name, profiles[m.name], m.request_rate_per_s / copies,
                                       m.ttft_slo_s))
    return demands


def _kv_shape(name: str, model: ModelConfig, model_dir: Path) -> KVShape:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return KVShape(name, cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   _SLAB_KV_DTYPES[model.resolved_kv_dtype], model.tp)


def _arena_for(device: DeviceConfig, runtimes: list[RuntimePlan], fixed_bytes: int,
               ) -> tuple[ArenaPlan, dict[str, int]]:
    shapes = [_kv_shape(r.runtime_id, r.model, Path(r.model_dir)) for r in runtimes]
    slab_plan = plan_slabs(shapes)
    budget = device.kv_arena_bytes or int((device.memory_bytes - fixed_bytes)
                                          * ARENA_FRACTION_OF_FREE)
    arena_bytes = budget // slab_plan.slab_bytes * slab_plan.slab_bytes
    if arena_bytes < slab_plan.slab_bytes * len(runtimes):
        raise ConfigError(f"device {device.name}: a {budget} B arena holds fewer than one "
                          f"{slab_plan.slab_bytes} B slab per runtime; raise kv_arena_mib")
    pages = {r.runtime_id: slab_plan.format_of(r.runtime_id).tokens_per_block for r in runtimes}
    return ArenaPlan(device, slab_plan, arena_bytes), pages


def make_plan(config: FleetConfig, cache_dir: str | None = None) -> FleetPlan:
    """Everything the launcher will do, decided; raises ConfigError/PlacementInfeasible."""
    devices = resolve_devices(config)
    if not devices:
        raise ConfigError("devices: auto found no device")
    model_dirs = {m.name: model_dir_of(m, cache_dir) for m in config.models}
    kinds = sorted({d.kind for d in devices})
    if len(kinds) > 1:
        raise ConfigError(f"devices of several kinds {kinds} on one node are not supported")
    dirs = profile_dirs(config.profile_dirs)
    profiles = {m.name: find_profile(m, kinds[0], dirs, model_dirs[m.name])
                for m in config.models}
    gpus = [GpuSpec(i, d.memory_bytes, d.kind) for i, d in enumerate(devices)]
    placement = get_placement_policy(config.placement).place(_demands(config, profiles), gpus)
    if placement.unplaced:
        raise PlacementInfeasible("the placer could not place every model:\n  " + "\n  ".join(
            f"{u.model}: {u.reason}" for u in placement.unplaced))
    runtimes: list[RuntimePlan] = []
    for replica in placement.replicas:
        model = config.model(replica.model.split("#")[0])
        if len(replica.gpu_ids) > 1:
            raise ConfigError(f"model {model.name}: TP over {len(replica.gpu_ids)} devices is "
                              "not supported by the launcher yet; use tp: 1")
        device = devices[replica.gpu_ids[0]]
        check_device_support(model, device)
        index = sum(1 for r in runtimes if r.model.name == model.name)
        runtimes.append(RuntimePlan(f"{model.name}-r{index}", model,
                                    str(model_dirs[model.name]), index, device, None))
    return _with_arenas(config, devices, profiles, placement, runtimes)


def _with_arenas(config: FleetConfig, devices: tuple[DeviceConfig, ...],
                 profiles: dict[str, ModelProfile], placement: PlacementPlan,
                 runtimes: list[RuntimePlan]) -> FleetPlan:
    if config.kv_pool == "sglang":
        return FleetPlan(config, devices, profiles, placement, (), tuple(runtimes))
    arenas, pages = [], {}
    for gpu_id, device in enumerate(devices):
        on_device = [r for r in runtimes if r.device.name == device.name]
        if on_device:
            arena, device_pages = _arena_for(device, on_device, placement.fixed_bytes_on(gpu_id))
            arenas.append(arena)
            pages.update(device_pages)
    paged = tuple(RuntimePlan(r.runtime_id, r.model, r.model_dir, r.replica, r.device,
                              pages[r.runtime_id]) for r in runtimes)
    return FleetPlan(config, devices, profiles, placement, tuple(arenas), paged)

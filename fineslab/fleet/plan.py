"""From a fleet config to a fleet plan: devices, profiles, the global placer, arenas, runtimes.

    config --resolve_devices--> devices --find_profile--> demands --placer--> PlacementPlan
           --plan_arenas--> one SlabPlan + arena size per device (pages chosen so that
                            models' blocks coincide and share key pools)
           --> RuntimePlan per model replica: device, runtime id, SGLang page size and flags

Nothing here starts a process, touches shared memory or writes a quantized checkpoint, so
`--dry-run` is `make_plan` + print (generated presets are written into the model cache, about a
second each). Quantized checkpoints are prepared by the Fleet at start, into `prepared_dir`.
Arena size per device: `kv_arena_mib` from the config, else 90% of what the placement leaves
after the fixed footprints F_M (weights, activations, base KV) of the replicas on it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fineslab import cpu_mode
from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError, PlacementInfeasible
from fineslab.fleet.config import (
    AUTO_CPU_ARENA_BYTES,
    AUTO_CPU_MEMORY_FRACTION,
    DeviceConfig,
    FleetConfig,
    ModelConfig,
    flag_value,
)
from fineslab.fleet.profiles import find_profile, profile_dirs
from fineslab.fleet.selectn_interval import resolve_intervals
from fineslab.models.generate import ensure_model
from fineslab.quant.checkpoint import read_config
from fineslab.quant.serving import describe_serving, served_dir_name
from fineslab.scheduler.placement import GpuSpec, ModelDemand, PlacementPlan, get_placement_policy
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.slabs import KVShape, SlabPlan, plan_slabs
from fineslab.slabs.key_sharing import WasteModel, plan_shared_slabs
from fineslab.slabs.sizing import DEFAULT_PAGE_SIZES
from fineslab.tables import format_table

logger = logging.getLogger(__name__)

MIB = float(1 << 20)
ARENA_FRACTION_OF_FREE = 0.9
#: An elastic runtime's weight slabs: its checkpoint's bytes plus this share, and one slab.
WEIGHT_MARGIN = 0.02
#: SGLang picks its prefill chunk by device memory, 2048 to 16384 tokens, all multiples of 2048,
#: and asserts that the chunk is a whole number of pages.
SGLANG_SMALLEST_DEFAULT_CHUNK = 2048
#: The chunk the launcher sets for a page that 2048 is not a multiple of: whole pages, at most
#: SGLang's default where it cannot read the device memory.
PAGED_CHUNK_TOKENS = 4096
CHUNK_FLAG = "--chunked-prefill-size"


@dataclass(frozen=True)
class RuntimePlan:
    """One SGLang runtime to start: a replica of a model on one device."""

    runtime_id: str
    model: ModelConfig
    model_dir: str  # the source model (tokenizer, KV geometry); the served checkpoint may differ
    replica: int
    device: DeviceConfig
    page_size: int | None  # the arena block's tokens; None on SGLang's own pool
    key_pool: bool = False  # shares its block stride's slabs with other runtimes on the device
    #: An elastic runtime the device's weight room does not hold awake with the others: the
    #: launcher starts it after them and puts it to sleep at once.
    starts_asleep: bool = False

    @property
    def weights_in_arena(self) -> bool:
        """Elastic and streaming models' weights live in weight slabs of the arena
        (docs/elastic.md, docs/streaming.md)."""
        return self.model.weights_in_arena

    @property
    def prepare_device(self) -> str:
        """"cpu" or the CUDA device: what the checkpoint is prepared for."""
        return "cpu" if self.device.is_cpu else self.device.name

    @property
    def serving(self) -> str:
        return describe_serving(self.model.precision, self.model.resolved_kv_dtype,
                                self.prepare_device)


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
    prepared_dir: str  # where quantized checkpoints and FP8 KV scales are prepared

    def prepared_dir_of(self, runtime: RuntimePlan) -> Path:
        """The folder `fineslab.quant.serving.prepare_served_model` writes this model into."""
        return Path(self.prepared_dir) / served_dir_name(
            Path(runtime.model_dir), runtime.model.precision, runtime.model.resolved_kv_dtype,
            runtime.prepare_device)

    def runtimes_of(self, model: str) -> list[RuntimePlan]:
        return [r for r in self.runtimes if r.model.name == model]

    def _block_cells(self, runtime: RuntimePlan) -> list[object]:
        """The runtime's arena block stride and padding waste, "-" on SGLang's own pool."""
        for arena in self.arenas:
            if arena.device.name == runtime.device.name:
                fmt = arena.slab_plan.format_of(runtime.runtime_id)
                return [fmt.block_stride_bytes, f"{fmt.padding_waste:.2%}"]
        return ["-", "-"]

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
                 r.model.resolved_kv_dtype, r.page_size or "-", *self._block_cells(r),
                 "key pool" if r.key_pool else "own" if r.page_size else "-",
                 f"{self.profiles[r.model.name].source}", r.serving, _sleeps_cell(r),
                 _streams_cell(r), r.model_dir]
                for r in self.runtimes]
        text += ["runtimes", format_table(
            ["runtime", "model", "device", "precision", "kv", "page", "block_B", "padding",
             "slabs", "profile", "serves", "sleeps", "streams", "path"], rows)]
        if any(r.serving != "source ckpt" for r in self.runtimes):
            text.append(f"quantized checkpoints and KV scales: prepared at start in "
                        f"{self.prepared_dir} (reused while the source is unchanged)")
        return "\n".join(text)


def _sleeps(model: ModelConfig) -> str:
    """When a model sleeps, for the runtimes table: never (weights outside the arena), only
    when asked (pinned), or after its idle timeout."""
    if model.pinned:
        return "pinned"
    return "never" if model.idle_timeout_s is None else f"idle {model.idle_timeout_s:g} s"


def _sleeps_cell(runtime: RuntimePlan) -> str:
    return _sleeps(runtime.model) + (", starts asleep" if runtime.starts_asleep else "")


def _streams_cell(runtime: RuntimePlan) -> str:
    """Layer streaming (docs/streaming.md): Select-N's layers, Oneiros' cap, or "-"."""
    streaming = runtime.model.layer_streaming
    if streaming is None:
        return "-"
    interval = streaming.layers_interval
    if streaming.policy == "selectn" and interval is not None:
        from fineslab.scheduler.selectn import offload_layers

        auto = " (auto)" if streaming.auto else ""
        if interval == 0:
            return f"selectn i=0{auto}: nothing streams"
        layers = offload_layers(num_layers(Path(runtime.model_dir)), interval)
        return f"selectn i={interval}{auto}: layers {layers}"
    cap = "half the layers" if streaming.cap is None else f"{streaming.cap} layers"
    return f"oneiros: lends up to {cap} under KV pressure"


def resolve_devices(config: FleetConfig) -> tuple[DeviceConfig, ...]:
    """The configured devices, or for "auto" the CUDA GPUs, else one CPU device."""
    if config.devices is not None:
        return config.devices
    if cpu_mode.is_cpu_mode():
        import psutil

        memory = int(psutil.virtual_memory().total * AUTO_CPU_MEMORY_FRACTION)
        return (DeviceConfig.of_bytes("cpu", "cpu", memory, AUTO_CPU_ARENA_BYTES),)
    import torch

    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(DeviceConfig.of_bytes(f"cuda:{i}", gpu_kind(props.name),
                                             int(props.total_memory)))
    return tuple(devices)


def gpu_kind(device_name: str) -> str:
    """The profile kind of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100")."""
    name = device_name.lower()
    return next((k for k in ("h200", "h100", "a100") if k in name), name.replace(" ", "-"))


def model_dir_of(model: ModelConfig, cache_dir: str | None = None) -> Path:
    """The model folder: `path` as given, or the preset generated into the model cache."""
    if model.path is not None:
        path = Path(model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model {model.name}: {path} has no config.json")
        return path
    assert model.preset is not None  # the config guarantees one of them
    return ensure_model(model.preset, cache_dir or FineslabEnv.from_environ().model_cache_dir)


def check_device_support(model: ModelConfig, device: DeviceConfig, kv_pool: str) -> None:
    """On CPU, FP8 KV is fineslab's FP8 slab pool: SGLang 0.5.23 keeps FP8 KV on CPU only with
    Intel AMX kernels (absent from the CPU install), and its torch_native attention ignores the
    per-layer scales. fp8 and awq weights run on CPU (docs/precisions.md)."""
    if device.is_cpu and model.resolved_kv_dtype == "fp8_e4m3" and kv_pool != "arena":
        raise ConfigError(f"model {model.name}: FP8 KV on CPU is stored only in the slab arena "
                          "(SGLang's CPU FP8 KV needs Intel AMX kernels); use kv_pool: arena")


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
    return KVShape.from_hf_config(read_config(model_dir), name, model.kv, model.tp)


def device_slab_plan(shapes: list[KVShape], budget_bytes: int,
                     page_sizes: tuple[int, ...]) -> SlabPlan:
    """The slab plan of one device: the key-sharing plan (`plan_shared_slabs`, the one the
    fragmentation benchmark measures as `slab`), whose pages make blocks of different models
    coincide so that they draw on one key pool, each model weighted by an equal share of the
    arena. When no slab size within its range keeps every model within the padding bound (a
    block above 64 MiB), `plan_slabs`, whose range reaches 256 MiB and which pools only the
    blocks that coincide anyway."""
    try:
        return plan_shared_slabs(shapes, page_sizes=page_sizes,
                                 waste=WasteModel(model_kv_bytes=budget_bytes / len(shapes)))
    except ConfigError as exc:
        logger.warning("key-sharing slab plan not possible (%s); planning slabs per model", exc)
        return plan_slabs(shapes, page_sizes=page_sizes)


def checkpoint_bytes(model_dir: Path) -> int:
    """The bytes of a checkpoint's weight files: what its parameters take, about (the weight
    region adds alignment; quantized checkpoints prepared from it are smaller)."""
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin")
               for f in model_dir.glob(pattern))


def num_layers(model_dir: Path) -> int:
    """The checkpoint's decoder layers (`num_hidden_layers` of its config.json; 0 unknown)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("num_hidden_layers") or config.get("text_config", {}).get(
        "num_hidden_layers", 0))


def weight_slabs(model_dir: Path, slab_bytes: int, layer_aligned: bool = False) -> int:
    """Weight slabs the arena sets aside for an elastic or streaming runtime of this checkpoint:
    its bytes with WEIGHT_MARGIN for the region's alignment, whole slabs, and one more; with
    `layer_aligned` (streaming: each layer starts a slab) one more per layer."""
    slabs = -(-int(checkpoint_bytes(model_dir) * (1 + WEIGHT_MARGIN)) // slab_bytes) + 1
    return slabs + (num_layers(model_dir) if layer_aligned else 0)


def runtime_weight_slabs(plan: RuntimePlan, slab_bytes: int) -> int:
    return weight_slabs(Path(plan.model_dir), slab_bytes, plan.model.layer_streaming is not None)


def _arena_for(device: DeviceConfig, runtimes: list[RuntimePlan], fixed_bytes: int,
               page_sizes: tuple[int, ...]) -> tuple[ArenaPlan, dict[str, int], set[str]]:
    """The arena of one device: the KV budget (`kv_arena_mib`, else ARENA_FRACTION_OF_FREE of
    what the placement leaves), plus room for the weights of its elastic runtimes, whose
    weights the placement counted in the fixed footprint and which now live in the arena.
    Returns the plan, each runtime's page, and the runtimes that start asleep."""
    shapes = [_kv_shape(r.runtime_id, r.model, Path(r.model_dir)) for r in runtimes]
    budget = device.kv_arena_bytes or int((device.memory_bytes - fixed_bytes)
                                          * ARENA_FRACTION_OF_FREE)
    slab_plan = device_slab_plan(shapes, budget, page_sizes)
    slab = slab_plan.slab_bytes
    room, asleep = _weight_room(device, [r for r in runtimes if r.weights_in_arena], slab,
                                budget // slab)
    # Weights never take slab 0, the padding slab, which the first KV draw parks whole: with
    # weights in the arena it is one slab on top of the KV budget and the weight room, so
    # neither loses it (without it a start-asleep wave filled the arena and its warmup hung).
    padding = 1 if room else 0
    arena_bytes = (budget // slab + room + padding) * slab
    if arena_bytes < slab * len(runtimes):
        raise ConfigError(f"device {device.name}: a {budget} B arena holds fewer than one "
                          f"{slab} B slab per runtime; raise kv_arena_mib")
    pages = {r.runtime_id: slab_plan.format_of(r.runtime_id).tokens_per_block for r in runtimes}
    return ArenaPlan(device, slab_plan, arena_bytes), pages, asleep


#: KV slabs a runtime that starts asleep needs beside its weights: SGLang's warmup request
#: allocates KV before the runtime is healthy and can be put to sleep.
START_KV_SLABS = 1


def _weight_room(device: DeviceConfig, elastic: list[RuntimePlan], slab_bytes: int,
                 kv_slabs: int) -> tuple[int, set[str]]:
    """Slabs for elastic weights on a device, and the runtimes that start asleep.

    Without `weights_arena_mib`, room for all of them. With it, the device is over-committed:
    pinned models are awake (they must fit), then the others in config order while they fit;
    the rest start asleep. Each of those starts after the awake ones, loads into the free
    slabs (the KV budget is empty then) with one slab of KV for its warmup, and sleeps at
    once, so it must fit there."""
    need = {r.runtime_id: runtime_weight_slabs(r, slab_bytes) for r in elastic}
    if device.weights_arena_bytes is None:
        return sum(need.values()), set()
    room = device.weights_arena_bytes // slab_bytes
    awake, asleep, used = [], set(), 0
    for r in sorted(elastic, key=lambda r: not r.model.always_awake):  # stable: config order
        if used + need[r.runtime_id] <= room:
            awake.append(r)
            used += need[r.runtime_id]
        elif r.model.always_awake:
            kind = "pinned" if r.model.pinned else "never-sleeping (streaming)"
            raise ConfigError(
                f"device {device.name}: {kind} model {r.model.name} needs "
                f"{need[r.runtime_id]} weight slab(s) but weights_arena_mib leaves "
                f"{room - used} after the other models that are always awake; raise "
                "weights_arena_mib or unpin a model")
        else:
            asleep.add(r.runtime_id)
    free_at_start = kv_slabs + room - used - START_KV_SLABS  # its warmup's KV slab
    too_big = sorted(f"{r.model.name} ({need[r.runtime_id]})" for r in elastic
                     if r.runtime_id in asleep and need[r.runtime_id] > free_at_start)
    if too_big:
        raise ConfigError(
            f"device {device.name}: models that start asleep load first into the free slabs "
            f"({free_at_start} once the awake models are loaded); too few for {too_big} "
            "weight slabs; raise kv_arena_mib or weights_arena_mib")
    return room, asleep


def prefill_chunk_args(runtime_id: str, page_size: int, extra_args: tuple[str, ...]
                       ) -> tuple[str, ...]:
    """The `--chunked-prefill-size` a runtime at `page_size` needs, if any: none when
    `extra_args` sets one (ConfigError unless whole pages, which SGLang asserts at start) or when
    SGLang's own default is whole pages; else the largest whole-page chunk up to 4096 tokens."""
    given = flag_value(extra_args, CHUNK_FLAG)
    if given is not None:
        try:
            tokens = int(given)
        except ValueError:
            raise ConfigError(f"runtime {runtime_id}: {CHUNK_FLAG} {given!r} is not an integer"
                              ) from None
        if tokens > 0 and tokens % page_size:
            raise ConfigError(f"runtime {runtime_id}: {CHUNK_FLAG} {tokens} is not a multiple "
                              f"of its arena page size {page_size} (SGLang requires whole pages)")
        return ()
    if SGLANG_SMALLEST_DEFAULT_CHUNK % page_size == 0:
        return ()
    return (CHUNK_FLAG, str(max(1, PAGED_CHUNK_TOKENS // page_size) * page_size))



def key_pooled(slab_plan: SlabPlan) -> set[str]:
    """The runtimes of a device whose block stride another runtime there shares: they join
    their key's pool (fineslab.slabs.pooled) instead of keeping slabs of their own."""
    strides = [f.block_stride_bytes for f in slab_plan.formats]
    return {f.name for f in slab_plan.formats if strides.count(f.block_stride_bytes) > 1}


def make_plan(config: FleetConfig, cache_dir: str | None = None, *,
              prepared_dir: str | Path | None = None,
              page_sizes: tuple[int, ...] = DEFAULT_PAGE_SIZES,
              placement: PlacementPlan | None = None) -> FleetPlan:
    """Everything the launcher will do, decided; raises ConfigError/PlacementInfeasible.

    `prepared_dir` (default `<model cache>/prepared`) receives the quantized checkpoints;
    `page_sizes` are the arena block sizes the slab plan may choose from. `placement`, one
    decided already (a cluster's node share of the global placement, fineslab.cluster.plan),
    replaces the placer's; its GPU ids index this node's devices."""
    devices = resolve_devices(config)
    if not devices:
        raise ConfigError("devices: auto found no device")
    cache_dir = cache_dir or FineslabEnv.from_environ().model_cache_dir
    model_dirs = {m.name: model_dir_of(m, cache_dir) for m in config.models}
    kinds = sorted({d.kind for d in devices})
    if len(kinds) > 1:
        raise ConfigError(f"devices of several kinds {kinds} on one node are not supported")
    dirs = profile_dirs(config.profile_dirs)
    profiles = {m.name: find_profile(m, kinds[0], dirs, model_dirs[m.name])
                for m in config.models}
    config, _ = resolve_intervals(config, profiles, model_dirs, kinds[0])
    if placement is None:
        gpus = [GpuSpec(i, d.memory_bytes, d.kind) for i, d in enumerate(devices)]
        placement = get_placement_policy(config.placement).place(_demands(config, profiles),
                                                                 gpus)
    elif len(placement.gpus) != len(devices):
        raise ConfigError(f"the given placement is over {len(placement.gpus)} devices, the node "
                          f"has {len(devices)}")
    if placement.unplaced:  # place() raises first; kept for a policy that does not
        raise PlacementInfeasible("the placer could not place every model:\n  " + "\n  ".join(
            f"{u.model}: {u.reason}" for u in placement.unplaced))
    for short in placement.reduced:
        logger.warning("model %s placed with less than its SLO sizing: %s", short.model,
                       short.reason)
    runtimes: list[RuntimePlan] = []
    for replica in placement.replicas:
        model = config.model(replica.model.split("#")[0])
        if len(replica.gpu_ids) > 1:
            raise ConfigError(f"model {model.name}: TP over {len(replica.gpu_ids)} devices is "
                              "not supported by the launcher yet; use tp: 1")
        device = devices[replica.gpu_ids[0]]
        check_device_support(model, device, config.kv_pool)
        index = sum(1 for r in runtimes if r.model.name == model.name)
        runtimes.append(RuntimePlan(f"{model.name}-r{index}", model,
                                    str(model_dirs[model.name]), index, device, None))
    for model in config.models:
        kind = "elastic models (idle_timeout_s, pinned)" if model.elastic else \
            "streaming models (layer_streaming)"
        if model.weights_in_arena and any(r.model.name == model.name and not r.device.is_cpu
                                          for r in runtimes):
            raise ConfigError(f"model {model.name}: {kind} run on CPU devices only in this "
                              "version: the CUDA path that loads weights into the arena is not "
                              "built (docs/elastic.md)")
        if model.weights_in_arena and sum(r.model.name == model.name for r in runtimes) > 1:
            raise ConfigError(f"model {model.name}: the placer gave one of the {kind} several "
                              "replicas; they run one in this version (replicas: 1)")
    plan = FleetPlan(config, devices, profiles, placement, (), tuple(runtimes),
                     str(prepared_dir or Path(cache_dir) / "prepared"))
    return _with_arenas(plan, page_sizes)


def _with_arenas(plan: FleetPlan, page_sizes: tuple[int, ...]) -> FleetPlan:
    if plan.config.kv_pool == "sglang":
        return plan
    arenas, pages, pooled, asleep = [], {}, set(), set()
    for gpu_id, device in enumerate(plan.devices):
        on_device = [r for r in plan.runtimes if r.device.name == device.name]
        if on_device:
            arena, device_pages, device_asleep = _arena_for(
                device, on_device, plan.placement.fixed_bytes_on(gpu_id), page_sizes)
            arenas.append(arena)
            pages.update(device_pages)
            pooled |= key_pooled(arena.slab_plan)
            asleep |= device_asleep
    paged = tuple(dataclasses.replace(r, page_size=pages[r.runtime_id],
                                      key_pool=r.runtime_id in pooled,
                                      starts_asleep=r.runtime_id in asleep)
                  for r in plan.runtimes)
    for r in paged:  # a chunk SGLang would refuse at start is a config error now
        prefill_chunk_args(r.runtime_id, pages[r.runtime_id], r.model.extra_args)
    return dataclasses.replace(plan, arenas=tuple(arenas), runtimes=paged)

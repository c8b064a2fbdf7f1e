"""The fleet configuration: YAML in, one frozen `FleetConfig` out, every problem a `ConfigError`.

The config is its pydantic models (one shape, from the file to every part of the fleet): they
check the YAML's shape (unknown keys, types, ranges), and the errors are rewritten into one
message per problem naming the path in the file (`models[1].kv_dtype: ...`); `check_fleet`
adds the rules that span fields (unique names, KV dtype vs activation dtype, precision per
device). Sizes stay in the YAML's units (`memory_gib`, `kv_arena_mib`, `max_body_mib`), with
byte properties beside them; relative paths are resolved against the file's folder.

    fleet_id: demo                  # names the arenas: /dev/shm/fineslab-<fleet_id>-<device>.*
    devices: auto                   # or a list: [{name: cpu, kind: cpu, memory_gib: 8,
                                    #               kv_arena_mib: 256}, {name: "cuda:0", ...}]
    kv_pool: arena                  # "sglang": runtimes keep SGLang's own pool (no plugin)
    placement: mme                  # global placer (fineslab.scheduler.placement)
    batch_policy: adaptive-early-shed  # or adaptive (Algorithm 2 as written), adaptive-margin,
                                    #   adaptive-early-shed-margin, fcfs, ...
    local_scheduler: router         # "engine": the policy also picks each runtime's prefill
                                    #   batches inside SGLang, by the router's deadlines
    engine_refresh: true            # engine: rescale the profile by the prefill steps each
                                    #   runtime times while serving (false: as profiled)
    router: {host: 127.0.0.1, port: 8000, api_key_env: null, on_drop: reject,
             drop_status: 429, retry_after_s: 1, max_running_requests: 32,
             upstream_timeout_s: 600, max_body_mib: 4}
    models:
      - name: llama-bf16            # the OpenAI `model` field
        preset: llama-tiny          # or path: /models/x (exactly one of them)
        precision: bf16             # weights: bf16 | fp16 | fp8 | awq | qoq (W4A8; checkpoints
                                    #   prepared by fineslab.quant.serving at start)
        kv_dtype: auto              # auto (qoq: int4) | bf16 | fp16 | fp8_e4m3 | int4 (KV4,
                                    #   arena only)
        tp: 1
        ttft_slo_s: 2.0
        request_rate_per_s: 1.0
        replicas: null              # null: as many as the placer sizes
        profile: null               # a profile name or file; null: <preset>--<precision>--<kind>
        extra_args: []              # more SGLang arguments (not those precision/kv_dtype set)
        env: {}                     # more environment for the runtime (e.g. OMP_NUM_THREADS)
        idle_timeout_s: null        # elastic: sleeps when idle this long (or pinned: true)
        layer_streaming: null       # {policy: selectn, interval: 4}, {policy: selectn,
                                    #   interval: auto, tpot_slo_s: 0.2} or {policy: oneiros,
                                    #   cap: 2, priority: 0} (docs/streaming.md)
        prefix_lending: null        # {cap: 0.5, window_s: 10, check_s: 1}: evicted prefix
                                    #   pages kept in the arena's free slabs (docs/prefix.md)
        cache_squeeze: true         # false: keeps its prefix cache when a neighbour's request
                                    #   is short of arena memory, and never asks for theirs
                                    #   (docs/plugin.md, "The cache squeeze")
    supervision: {probe_interval_s: 5, probe_timeout_s: 20, probe_failures: 2,
                  backoff_max_s: 60, stable_after_s: 300, health_timeout_s: 600}
    cluster: null                   # {engine: ray, address: auto, min_nodes: 1, wait_nodes_s: 60}:
                                    #   the fleet over every node of a Ray cluster; `devices`
                                    #   are each node's (docs/cluster.md)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fineslab.errors import ConfigError
from fineslab.precisions import (
    CONFIG_KV_DTYPES,
    KV_STORAGE,
    WEIGHT_FORMATS,
    WeightFormat,
    config_kv_dtype,
)
from fineslab.slabs.formats import KVDtype

MIB = 1 << 20
GIB = 1 << 30
#: The weight precisions and KV dtype names a model may name (the registry's, fineslab.precisions).
PRECISIONS = tuple(WEIGHT_FORMATS)
KV_DTYPES = CONFIG_KV_DTYPES
#: SGLang arguments the launcher derives from precision, kv_dtype, the plan and the name;
#: `extra_args` may not set them (a second `--quantization` would silently win).
RESERVED_ARGS = ("--model-path", "--served-model-name", "--dtype", "--quantization",
                 "--kv-cache-dtype", "--quantization-param-path", "--page-size", "--port",
                 "--device", "--base-gpu-id", "--tp-size", "--tp")
#: Environment the launcher sets itself (arena join, KV format, CPU mode).
RESERVED_ENV_PREFIXES = ("FINESLAB_", "SGLANG_USE_CPU_ENGINE", "PYTHONPATH")
#: Sizes of the CPU device when the config says `devices: auto`.
AUTO_CPU_MEMORY_FRACTION = 0.5
AUTO_CPU_ARENA_BYTES = 256 * MIB


_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _resolve_path(path: str | None, info: ValidationInfo) -> str | None:
    """Relative paths in a config file are relative to the file's folder (the validation
    context's `base_dir`; the working directory without one)."""
    if path is None:
        return None
    base_dir = Path((info.context or {}).get("base_dir") or Path.cwd())
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else (base_dir / expanded).resolve())


class DeviceConfig(_Strict):
    """One device of the node: `name` is what runtimes use ("cpu", "cuda:0"), `kind` selects
    profiles ("cpu", "h100", ...). `kv_arena_mib` None: what the placement leaves free."""

    name: str = Field(pattern=r"^(cpu|cuda:\d+)$")
    kind: str = Field(min_length=1)
    memory_gib: float = Field(gt=0)
    kv_arena_mib: float | None = Field(default=None, gt=0)
    #: Room in the arena for elastic models' weights; None: all of them, awake at once. Less
    #: over-commits the device: the models that do not fit start asleep (plan.py).
    weights_arena_mib: float | None = Field(default=None, ge=0)

    @field_validator("kind")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()

    @classmethod
    def of_bytes(cls, name: str, kind: str, memory_bytes: int,
                 kv_arena_bytes: int | None = None) -> DeviceConfig:
        """A device measured in bytes (`devices: auto`, the cluster's residual memory)."""
        return cls(name=name, kind=kind, memory_gib=memory_bytes / GIB,
                   kv_arena_mib=None if kv_arena_bytes is None else kv_arena_bytes / MIB)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def kv_arena_bytes(self) -> int | None:
        return None if self.kv_arena_mib is None else int(self.kv_arena_mib * MIB)

    @property
    def weights_arena_bytes(self) -> int | None:
        return None if self.weights_arena_mib is None else int(self.weights_arena_mib * MIB)

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


class StreamingConfig(_Strict):
    """A model's layer streaming (docs/streaming.md): `selectn` streams the last layer of every
    `interval` from the start; `oneiros` lends up to `cap` layers when a neighbour on its
    device runs out of KV (lower `priority` lends first) and takes them back when it is over.

    `interval: auto` (with `tpot_slo_s`): the plan picks the smallest interval whose predicted
    TTFT (the model's ttft_slo_s) and TPOT hold (fleet/selectn_interval.py) and puts it in
    `interval`; `auto` stays true on the resolved copy."""

    policy: Literal["selectn", "oneiros"]
    interval: Annotated[int, Field(ge=2)] | Literal["auto"] | None = None
    cap: int | None = Field(default=None, ge=1)
    priority: int = 0
    slots: Literal[1, 2] = 1
    tpot_slo_s: float | None = Field(default=None, gt=0, le=3600)
    #: host -> device copy bandwidth the interval is sized for (default per device kind)
    host_link_gib_s: float | None = Field(default=None, gt=0, le=10000)
    _auto: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _policy_fields(self) -> StreamingConfig:
        if self.policy == "selectn" and self.interval is None:
            raise ValueError("selectn streams the last layer of every `interval` layers: give "
                             "interval (>= 2, or auto with tpot_slo_s)")
        if self.policy == "selectn" and self.cap is not None:
            raise ValueError("`cap` is oneiros': selectn's `interval` decides its layers")
        if self.policy == "oneiros" and self.interval is not None:
            raise ValueError("`interval` is selectn's: oneiros lends up to `cap` layers")
        auto = self.interval == "auto"
        if auto and self.tpot_slo_s is None:
            raise ValueError("interval: auto sizes the interval for the model's ttft_slo_s and "
                             "a TPOT SLO: give tpot_slo_s (seconds)")
        if not auto and (self.tpot_slo_s is not None or self.host_link_gib_s is not None):
            raise ValueError("tpot_slo_s and host_link_gib_s size selectn's interval: they go "
                             "with interval: auto")
        self._auto = auto
        return self

    @property
    def auto(self) -> bool:
        """Whether the config asked for `interval: auto` (resolved or not)."""
        return self._auto

    @property
    def layers_interval(self) -> int | None:
        """selectn's interval once known (None: oneiros, or `auto` not yet resolved)."""
        return self.interval if isinstance(self.interval, int) else None

    def resolved(self, interval: int) -> StreamingConfig:
        """This config with `interval: auto` resolved to `interval` (0: nothing streams)."""
        return self.model_copy(update={"interval": interval})


def _one_of(value: str, known: tuple[str, ...]) -> str:
    """`value`, or pydantic's own error for a literal that is not one of `known`."""
    if value not in known:
        raise PydanticCustomError(
            "literal_error", "Input should be {expected}",
            {"expected": f"{', '.join(repr(k) for k in known[:-1])} or {known[-1]!r}"})
    return value


#: SGLang flags that would take the lent tier's radix cache away.
_LENDING_CLASHES = ("--disable-radix-cache", "--radix-cache-backend",
                    "--enable-hierarchical-cache", "--enable-hicache")


class PrefixLendingConfig(_Strict):
    """A model's lent tier (SwiftCache, docs/prefix.md): its radix cache's evicted pages kept
    in the arena's free slabs, at most `cap` of the arena's slabs, less the headroom that
    Algorithm 1 (`window_s`, `check_s`) keeps for the device's other models."""

    cap: float = Field(default=0.5, gt=0, le=1)
    window_s: float = Field(default=10.0, ge=0, le=86400)
    check_s: float = Field(default=1.0, gt=0, le=86400)


class ModelConfig(_Strict):
    name: str = Field(pattern=_NAME)
    #: a model folder (relative to the config file's folder), or None with `preset`
    path: str | None = None
    preset: str | None = None
    precision: str = "bf16"
    kv_dtype: str = "auto"
    tp: int = Field(default=1, ge=1)
    ttft_slo_s: float = Field(gt=0)
    request_rate_per_s: float = Field(gt=0)
    replicas: int | None = Field(default=None, ge=1)
    profile: str | None = None
    max_running_requests: int | None = Field(default=None, ge=1)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    #: Elastic models (either field set) keep their weights in the arena and can sleep: an
    #: idle one sleeps after `idle_timeout_s`; a pinned one sleeps only when asked (`ctl`).
    idle_timeout_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    pinned: bool = False
    layer_streaming: StreamingConfig | None = None
    prefix_lending: PrefixLendingConfig | None = None
    #: The cache squeeze (sglang_plugin/cache_squeeze.py) for this model's runtimes.
    cache_squeeze: bool = True

    @field_validator("path")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _resolve_path(value, info)

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        return _one_of(value, PRECISIONS)

    @field_validator("kv_dtype")
    @classmethod
    def _known_kv_dtype(cls, value: str) -> str:
        return _one_of(value, KV_DTYPES)

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.preset is None):
            raise ValueError("give exactly one of `path` (a model folder) or `preset` "
                             "(a generated model: llama-tiny, qwen2-tiny, llama-small)")
        if self.pinned and self.idle_timeout_s is not None:
            raise ValueError("a pinned model never sleeps when idle: give `pinned` or "
                             "`idle_timeout_s`, not both")
        return self

    @property
    def elastic(self) -> bool:
        return self.idle_timeout_s is not None or self.pinned

    @property
    def weights_in_arena(self) -> bool:
        """Elastic and streaming models keep their weights in arena slabs."""
        return self.elastic or self.layer_streaming is not None

    @property
    def always_awake(self) -> bool:
        """Never put to sleep by the fleet: pinned, or weights in the arena without sleeping."""
        return self.pinned or not self.elastic

    @property
    def weight_format(self) -> WeightFormat:
        return WEIGHT_FORMATS[self.precision]

    @property
    def activation_dtype(self) -> str:
        return self.weight_format.activation.config_name

    @property
    def resolved_kv_dtype(self) -> str:
        """The KV storage type: "auto" means the precision's (the activation dtype; int4 for
        qoq, which is W4A8KV4)."""
        if self.kv_dtype == "auto":
            return self.weight_format.auto_kv.config_name
        return self.kv_dtype

    @property
    def kv(self) -> KVDtype:
        """`resolved_kv_dtype` as the arena's storage type."""
        return config_kv_dtype(self.resolved_kv_dtype)

    @property
    def profile_model(self) -> str:
        """The model part of the default profile name: the preset, else the folder name."""
        return self.preset or Path(self.path or self.name).name


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key_env: str | None = None
    on_drop: Literal["reject", "best_effort"] = "reject"
    drop_status: Literal[429, 503] = 429
    retry_after_s: int = Field(default=1, ge=0)
    max_running_requests: int = Field(default=32, ge=1)
    upstream_timeout_s: float = Field(default=600.0, gt=0, le=86400)
    max_body_mib: float = Field(default=4.0, ge=0.01, le=1024)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * MIB)


class SupervisionPolicy(_Strict):
    """How runtimes are watched and restarted (the fleet config's `supervision:` section)."""

    probe_interval_s: float = Field(default=5.0, gt=0)
    probe_timeout_s: float = Field(default=20.0, gt=0)
    probe_failures: int = Field(default=2, ge=1)
    backoff_max_s: float = Field(default=60.0, gt=0)
    stable_after_s: float = Field(default=300.0, ge=0)
    health_timeout_s: float = Field(default=600.0, gt=0)

    def backoff_s(self, consecutive: int) -> float:
        """The wait before the `consecutive`-th restart in a row (0-based)."""
        return 0.0 if consecutive == 0 else min(self.backoff_max_s, 2.0 ** min(consecutive - 1, 62))


class ClusterConfig(_Strict):
    """The fleet over the nodes of a Ray cluster (docs/cluster.md): `address` is Ray's ("auto":
    the cluster this machine is part of); start waits up to `wait_nodes_s` for `min_nodes`."""

    engine: Literal["ray"] = "ray"
    address: str = Field(default="auto", min_length=1)
    min_nodes: int = Field(default=1, ge=1, le=4096)
    wait_nodes_s: float = Field(default=60.0, ge=0, le=86400)


class FleetConfig(_Strict):
    """The fleet config: the YAML's shape as validated (module doc), one object from the file
    to every part of the fleet. `fleet_from_dict` also checks the rules that span fields."""

    fleet_id: str = Field(default="fineslab", pattern=_NAME)
    #: None: "auto", resolved by the launcher
    devices: tuple[DeviceConfig, ...] | None = None
    kv_pool: Literal["arena", "sglang"] = "arena"
    placement: str = "mme"
    batch_policy: str = "adaptive-early-shed"
    #: "router": the batch policy gates requests at the router, SGLang forms the batches;
    #: "engine": the same policy also picks SGLang's prefill batches (engine_policy.py)
    local_scheduler: Literal["router", "engine"] = "router"
    #: with "engine": scale the profile by the runtime's timed prefill steps (step_refresh.py)
    engine_refresh: bool = True
    router: RouterConfig = Field(default_factory=RouterConfig)
    models: tuple[ModelConfig, ...] = Field(min_length=1)
    profile_dirs: tuple[str, ...] = ()
    supervision: SupervisionPolicy = Field(default_factory=SupervisionPolicy)
    #: None: one machine, Ray never imported
    cluster: ClusterConfig | None = None
    _source: str = PrivateAttr(default="<dict>")

    @field_validator("devices", mode="before")
    @classmethod
    def _auto_devices(cls, value: Any) -> Any:
        return None if value == "auto" else value

    @field_validator("profile_dirs")
    @classmethod
    def _resolve_dirs(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        return tuple(_resolve_path(d, info) or d for d in value)

    @property
    def source(self) -> str:
        """Where the config came from (a file's path), for messages."""
        return self._source

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        raise ConfigError(f"no model named {name!r} in {self.source}")

    def with_models(self, models: Sequence[ModelConfig]) -> FleetConfig:
        """This config serving `models` instead (the plan's resolved or chosen ones)."""
        return self.model_copy(update={"models": tuple(models)})


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        lines.append(f"  {where.lstrip('.') or '(top level)'}: {err['msg']}")
    return f"invalid fleet config {source}:\n" + "\n".join(lines)


def check_fleet(config: FleetConfig) -> None:
    """Rules spanning fields; raises one ConfigError listing every problem."""
    problems = []
    names = [m.name for m in config.models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"models: duplicate names {duplicates}")
    for i, model in enumerate(config.models):
        problems += [f"models[{i}] ({model.name}): {p}" for p in _model_problems(model, config)]
    if config.devices is not None:
        device_names = [d.name for d in config.devices]
        if len(set(device_names)) != len(device_names):
            problems.append(f"devices: duplicate names {device_names}")
    if problems:
        raise ConfigError(f"invalid fleet config {config.source}:\n  " + "\n  ".join(problems))


def _flags_among(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """The flags of `flags` that `args` sets (as `--flag value` or `--flag=value`), sorted."""
    return sorted({a.split("=", 1)[0] for a in args} & set(flags))


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value the last `--flag value` or `--flag=value` of `args` gives (SGLang's parser
    keeps the last), None when `args` do not set it."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _model_problems(model: ModelConfig, config: FleetConfig) -> list[str]:
    problems = []
    budget = flag_value(model.extra_args, "--max-total-tokens")
    if budget is not None and not (budget.isdigit() and int(budget) > 0):
        problems.append(f"extra_args: --max-total-tokens must be a positive number of tokens, "
                        f"not {budget!r:.40}")
    kv, act = model.resolved_kv_dtype, model.activation_dtype
    if kv in ("bf16", "fp16") and kv != act:
        problems.append(f"kv_dtype {kv} needs activations in {kv}, but precision "
                        f"{model.precision} computes in {act}; use precision {kv} or kv_dtype auto")
    if KV_STORAGE[model.kv].arena_only and config.kv_pool != "arena":
        problems.append(f"kv_dtype {kv} is stored only in the slab arena (fineslab's KV4 pool); "
                        "use kv_pool: arena")
    flags = _flags_among(model.extra_args, RESERVED_ARGS)
    if flags:
        problems.append(f"extra_args may not set {flags}: the launcher derives them from "
                        "precision, kv_dtype and the plan (set precision / kv_dtype instead)")
    names = sorted(k for k in model.env if k.startswith(RESERVED_ENV_PREFIXES))
    if names:
        problems.append(f"env may not set {names}: the launcher sets them")
    if model.layer_streaming is not None and model.elastic:
        problems.append("a model streams layers or sleeps, not both, in this version: a wake "
                        "restores every layer, so it needs the slabs its lent layers gave away "
                        "(drop idle_timeout_s/pinned or layer_streaming)")
    if model.prefix_lending is not None:
        clash = _flags_among(model.extra_args, _LENDING_CLASHES)
        if clash:
            problems.append(f"prefix_lending keeps evicted pages through fineslab's radix "
                            f"cache; drop {clash} from extra_args")
        if config.kv_pool != "arena":
            problems.append("prefix_lending lends the slab arena's free slabs; use "
                            "kv_pool: arena")
        if model.tp > 1:
            problems.append("prefix_lending serves tp: 1 in this version")
    if config.local_scheduler == "engine" and model.tp > 1:
        problems.append("local_scheduler: engine serves tp: 1 in this version (every rank "
                        "would have to drop the same requests at the same step)")
    if model.weights_in_arena:
        kind, uses = ("an elastic model (idle_timeout_s or pinned)", "keeps its weights in") \
            if model.elastic else ("a streaming model", "lends weight slabs to")
        if config.kv_pool != "arena":
            problems.append(f"{kind} {uses} the slab arena; use kv_pool: arena")
        if (model.replicas or 1) > 1:
            problems.append(f"{kind} runs one replica in this version; set replicas: 1")
    return problems


def fleet_from_dict(data: Any, source: str = "<dict>", base_dir: Path | None = None,
                    ) -> FleetConfig:
    """Validate a parsed YAML document; ConfigError lists every problem with its path."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid fleet config {source}: expected a mapping at the top level, "
                          f"got {type(data).__name__}")
    try:
        config = FleetConfig.model_validate(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    config._source = source
    check_fleet(config)
    return config


def load_fleet_config(path: str | Path) -> FleetConfig:
    """Read and validate a fleet YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read fleet config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"fleet config {path} is not valid YAML: {exc}") from exc
    return fleet_from_dict(data, str(path), path.resolve().parent)

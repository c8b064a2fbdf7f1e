"""How a runtime is told to join an arena, and which SGLang the plugin was written against.

The one configuration channel is the environment of the SGLang processes: the launcher sets
`FINESLAB_ARENA` (the arena's name) and `FINESLAB_RUNTIME_ID` (this model replica's id in the
slab table), `FINESLAB_KEY_POOL=1` when the runtime shares its block size's slabs with
other runtimes on the device (a key pool), and `FINESLAB_WEIGHTS_IN_ARENA=1` when its weights
go into the arena too. The first two unset: the plugin stays out of the
way. One without the other is an error, never a silent fallback to SGLang's own pool.

A KV format SGLang does not store itself (`fineslab.precisions.PLUGIN_KV_FORMATS`: KV4, and FP8
on CPU) is part of the join: `FINESLAB_KV_FORMAT=int4|fp8_e4m3`, and for FP8
`FINESLAB_KV_SCALES=<SGLang's --quantization-param-path JSON>` (unset: scales 1.0 and a
warning). Such a runtime runs with SGLang's `--kv-cache-dtype auto`; the plugin fits the arena
with the quantized block format and hands SGLang a `Kv4SlabKVPool` / `Fp8SlabKVPool`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from fineslab.env import (
    ARENA_VAR,
    CONTRACT_VAR,
    ENGINE_POLICY_VAR,
    KEY_POOL_VAR,
    KV_FORMAT_VAR,
    KV_SCALES_VAR,
    LAYER_STREAMING_VAR,
    PREFIX_LENDING_VAR,
    RUNTIME_ID_VAR,
    WEIGHTS_IN_ARENA_VAR,
    FineslabEnv,
)
from fineslab.errors import ConfigError
from fineslab.precisions import PLUGIN_KV_FORMATS
from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.slabs.contract import PlannedBlock, RuntimeContract
from fineslab.slabs.formats import BlockFormat, KVDtype

#: The radix-cache backend of the lent tier (`sglang_plugin/prefix_tier.py`), registered by a
#: join with `prefix_lending` and named by the launcher's `--radix-cache-backend`.
LENT_RADIX_BACKEND = "fineslab_lent"

#: The SGLang release whose hook targets and signatures this plugin was written and tested on.
TESTED_SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class ArenaJoin:
    """The arena this runtime keeps its KV in, and its id there."""

    arena_name: str
    runtime_id: str
    key_pool: bool = False
    #: Move the loaded weights into slabs of the arena (`FINESLAB_WEIGHTS_IN_ARENA=1`).
    weights_in_arena: bool = False
    #: Each layer on slabs of its own, lendable (`FINESLAB_LAYER_STREAMING=1`; needs the above).
    layer_streaming: bool = False
    #: A KV format the plugin's pools store (None: SGLang's KV dtype, the plain slab pool).
    kv_format: KVDtype | None = None
    #: FP8 only: the per-layer scales file (SGLang's `--quantization-param-path` JSON).
    kv_scales_path: str | None = None
    #: SwiftCache's lent tier (`FINESLAB_PREFIX_LENDING`): None = none; a number = the tier is
    #: on (the `fineslab_lent` radix-cache backend is registered) and may hold that many lent
    #: slabs until a lending round (the launcher's) moves the cap; 0 = none until then.
    prefix_lending: int | None = None
    #: The block the launcher planned (its runtime contract); SGLang's must match at join.
    planned_block: PlannedBlock | None = None
    #: The contract this join was read from (None: from the separate variables).
    contract_path: str | None = None

    def __post_init__(self) -> None:
        if not self.arena_name:
            raise ConfigError(f"{ARENA_VAR} is empty: name the arena to join")
        if not self.runtime_id:
            raise ConfigError(f"{RUNTIME_ID_VAR} is empty: give this runtime's id in the arena")
        if self.layer_streaming and not self.weights_in_arena:
            raise ConfigError(f"{LAYER_STREAMING_VAR}=1 needs {WEIGHTS_IN_ARENA_VAR}=1: only "
                              "weights in the arena can be lent and streamed")
        if self.kv_format is not None and self.kv_format not in PLUGIN_KV_FORMATS.values():
            raise ConfigError(f"{KV_FORMAT_VAR}: the plugin stores {sorted(PLUGIN_KV_FORMATS)}, "
                              f"not {self.kv_format.config_name}")
        if self.kv_scales_path is not None and self.kv_format is not KVDtype.FP8_E4M3:
            raise ConfigError(f"{KV_SCALES_VAR} is for {KV_FORMAT_VAR}=fp8_e4m3 only")
        if self.prefix_lending is not None and self.prefix_lending < 0:
            raise ConfigError(f"{PREFIX_LENDING_VAR} is a number of slabs, not negative")

    @classmethod
    def from_env(cls, env: FineslabEnv | None = None) -> ArenaJoin | None:
        """The join request in the environment, or None when the runtime is not asked to join."""
        env = env or FineslabEnv.from_environ()
        if env.contract_path is not None:
            return cls.from_contract(env)
        if env.arena_name is None and env.runtime_id is None:
            return None
        if env.arena_name is None or env.runtime_id is None:
            missing = ARENA_VAR if env.arena_name is None else RUNTIME_ID_VAR
            raise ConfigError(
                f"{ARENA_VAR} and {RUNTIME_ID_VAR} go together; {missing} is not set")
        kv_format = None
        if env.kv_format is not None:
            if env.kv_format not in PLUGIN_KV_FORMATS:
                raise ConfigError(f"{KV_FORMAT_VAR}={env.kv_format!r}: expected one of "
                                  f"{sorted(PLUGIN_KV_FORMATS)}")
            kv_format = PLUGIN_KV_FORMATS[env.kv_format]
        return cls(env.arena_name, env.runtime_id, env.key_pool, env.weights_in_arena,
                   env.layer_streaming, kv_format,
                   env.kv_scales_path if kv_format is KVDtype.FP8_E4M3 else None,
                   env.prefix_lending)

    @classmethod
    def from_contract(cls, env: FineslabEnv) -> ArenaJoin:
        """The join in the runtime contract `FINESLAB_CONTRACT` names (fineslab.slabs.contract);
        the arena and runtime id variables, when set, must name the same."""
        assert env.contract_path is not None
        contract = RuntimeContract.read(env.contract_path)
        for var, given, written in ((ARENA_VAR, env.arena_name, contract.arena),
                                    (RUNTIME_ID_VAR, env.runtime_id, contract.runtime_id)):
            if given is not None and given != written:
                raise ConfigError(f"{var}={given!r} but the runtime contract {CONTRACT_VAR}="
                                  f"{env.contract_path} says {written!r}")
        kv_format = None
        if contract.kv_format is not None:
            if contract.kv_format not in PLUGIN_KV_FORMATS:
                raise ConfigError(f"runtime contract {env.contract_path}: kv_format "
                                  f"{contract.kv_format!r}, expected one of "
                                  f"{sorted(PLUGIN_KV_FORMATS)}")
            kv_format = PLUGIN_KV_FORMATS[contract.kv_format]
        return cls(contract.arena, contract.runtime_id, contract.key_pool,
                   contract.weights_in_arena, contract.layer_streaming, kv_format,
                   contract.kv_scales_path if kv_format is KVDtype.FP8_E4M3 else None,
                   contract.prefix_lending, contract.block, env.contract_path)

    def contract(self, device: str, planned: BlockFormat | None,
                 files: Mapping[str, str] | None = None) -> RuntimeContract:
        """This join as a runtime contract, with the block the plan gives it."""
        return RuntimeContract(
            self.arena_name, self.runtime_id, device, self.key_pool, self.weights_in_arena,
            self.layer_streaming, None if self.kv_format is None else self.kv_format.config_name,
            self.kv_scales_path, self.prefix_lending,
            None if planned is None else PlannedBlock.of(planned), dict(files or {}))

    def check_block(self, built: BlockFormat) -> None:
        """ConfigError unless SGLang built the block the contract plans (none planned: none
        to check)."""
        if self.planned_block is not None:
            self.planned_block.check(built, self.runtime_id)

    def environ(self) -> dict[str, str]:
        """The variables a launcher puts in a runtime's environment to make it join."""
        variables = {ARENA_VAR: self.arena_name, RUNTIME_ID_VAR: self.runtime_id}
        if self.key_pool:
            variables[KEY_POOL_VAR] = "1"
        if self.weights_in_arena:
            variables[WEIGHTS_IN_ARENA_VAR] = "1"
        if self.layer_streaming:
            variables[LAYER_STREAMING_VAR] = "1"
        if self.kv_format is not None:
            variables[KV_FORMAT_VAR] = self.kv_format.config_name
        if self.kv_scales_path is not None:
            variables[KV_SCALES_VAR] = self.kv_scales_path
        if self.prefix_lending is not None:
            variables[PREFIX_LENDING_VAR] = str(self.prefix_lending)
        return variables


@dataclass(frozen=True)
class EngineSchedule:
    """The local scheduler inside a runtime (`FINESLAB_ENGINE_POLICY`, `engine_policy.py`):
    the batch policy's name, the model's TTFT SLO (the deadline of a request that carries none)
    and its TTFT predictor (chunked prefill: `chunk_tokens` and the profiled prefill curve,
    `prefill_s` as [tokens, seconds] points), the same the router decides with; `refresh`:
    scale that curve by the prefill steps the runtime times while serving
    (`step_refresh.py`; off, the profile decides as given); `publish`: the file the runtime
    writes those scales to, for the router's gate (`fineslab.scheduler.refreshed`; None:
    not written)."""

    policy: str
    ttft_slo_s: float
    chunk_tokens: int
    prefill_s: tuple[tuple[float, float], ...]
    refresh: bool = True
    publish: str | None = None

    def __post_init__(self) -> None:
        from fineslab.scheduler.local import BATCH_POLICIES

        if self.policy not in BATCH_POLICIES:
            raise ConfigError(f"{ENGINE_POLICY_VAR}: unknown batch policy {self.policy!r} "
                              f"(known: {sorted(BATCH_POLICIES)})")
        if not (math.isfinite(self.ttft_slo_s) and self.ttft_slo_s > 0):
            raise ConfigError(f"{ENGINE_POLICY_VAR}: ttft_slo_s must be a positive number")
        self.predictor()  # the curve and chunk size are checked where they are built

    @classmethod
    def for_model(cls, policy: str, ttft_slo_s: float, predictor: ChunkedPrefillPredictor,
                  refresh: bool = True, publish: str | None = None) -> EngineSchedule:
        points = tuple((x, y) for x, y in zip(predictor.prefill_s.xs, predictor.prefill_s.ys,
                                               strict=True))
        return cls(policy, ttft_slo_s, predictor.chunk_tokens, points, refresh, publish)

    def predictor(self) -> ChunkedPrefillPredictor:
        return ChunkedPrefillPredictor(PiecewiseLinear.from_points(self.prefill_s),
                                       self.chunk_tokens)

    def environ(self) -> dict[str, str]:
        return {ENGINE_POLICY_VAR: json.dumps(
            {"policy": self.policy, "ttft_slo_s": self.ttft_slo_s,
             "chunk_tokens": self.chunk_tokens, "prefill_s": [list(p) for p in self.prefill_s],
             "refresh": self.refresh, "publish": self.publish})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineSchedule | None:
        """The schedule in the environment; None when unset; ConfigError naming the variable
        when it is malformed (a runtime told to schedule must not silently fall back)."""
        raw = (os.environ if environ is None else environ).get(ENGINE_POLICY_VAR)
        if not raw:
            return None
        try:
            data = json.loads(raw)
            points = tuple((float(x), float(y)) for x, y in data["prefill_s"])
            refresh = data.get("refresh", True)
            if not isinstance(refresh, bool):
                raise TypeError(f"refresh must be true or false, got {refresh!r}")
            publish = data.get("publish")
            if publish is not None and not (isinstance(publish, str) and publish):
                raise TypeError(f"publish must be a file path or null, got {publish!r}")
            return cls(str(data["policy"]), float(data["ttft_slo_s"]), int(data["chunk_tokens"]),
                       points, refresh, publish)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{ENGINE_POLICY_VAR} is not a valid engine schedule "
                              f"({type(exc).__name__}: {exc})") from exc

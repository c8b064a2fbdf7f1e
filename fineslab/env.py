"""fineslab's environment variables, read in one place, only when asked.

Nothing reads `os.environ` at import time; callers take a `FineslabEnv` snapshot with
`FineslabEnv.from_environ()` at start-up and pass it down. Child processes that fineslab starts get
their variables from `child_environ()`, so the names live here and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fineslab.errors import ConfigError

#: Set to "1" to force CPU mode (stand-ins on the path, CPU device), "0" to forbid it; unset means
#: CPU mode exactly when no CUDA device is visible.
CPU_MODE_VAR = "FINESLAB_CPU_MODE"
#: Where generated models are cached (default: ~/.cache/fineslab/models).
MODEL_CACHE_VAR = "FINESLAB_MODEL_CACHE"
#: SGLang's own switch for its CPU engine; without it the scheduler imports vllm and dies.
SGLANG_CPU_ENGINE_VAR = "SGLANG_USE_CPU_ENGINE"
#: The slab arena an SGLang runtime joins (set by the launcher; read by the SGLang plugin).
#: Unset: the plugin does nothing and SGLang keeps its own KV pool.
ARENA_VAR = "FINESLAB_ARENA"
#: This runtime's id in the arena's slab table (required when FINESLAB_ARENA is set).
RUNTIME_ID_VAR = "FINESLAB_RUNTIME_ID"
#: "1": this runtime shares its key's slabs with the other runtimes of the same block stride
#: on its device (a key pool, fineslab.slabs.pooled). Set by the launcher when such exist.
KEY_POOL_VAR = "FINESLAB_KEY_POOL"
#: A fineslab-quantized KV storage format for a runtime that joins an arena: "int4" (KV4) or
#: "fp8_e4m3" (FP8 with per-layer scales, the CPU path). Unset: SGLang's own KV dtype.
KV_FORMAT_VAR = "FINESLAB_KV_FORMAT"
#: "1": this runtime moves its weights into whole slabs of the arena once SGLang has loaded
#: them (fineslab.slabs.weights; CPU only), so they show in the slab table and can sleep.
WEIGHTS_IN_ARENA_VAR = "FINESLAB_WEIGHTS_IN_ARENA"
#: Where a sleeping runtime's weights wait (its host copy; default: the temp folder).
WEIGHTS_DIR_VAR = "FINESLAB_WEIGHTS_DIR"
#: "1" (with FINESLAB_WEIGHTS_IN_ARENA): each decoder layer's weights on whole slabs of its own,
#: which the layer streamer can lend to KV and stream back (fineslab.sglang_plugin.streaming).
LAYER_STREAMING_VAR = "FINESLAB_LAYER_STREAMING"
#: SwiftCache's lent tier (issue #20), set: the tier is on and this runtime may hold that many
#: slabs lent for its evicted prefix pages (a whole number; 0: none until the launcher's
#: lending round, which moves the cap with the neighbours' demand). Unset: no lent tier.
PREFIX_LENDING_VAR = "FINESLAB_PREFIX_LENDING"
#: Algorithm 2 inside the runtime (issue #18): a JSON object {"policy", "ttft_slo_s",
#: "chunk_tokens", "prefill_s"} naming the local scheduler's batch policy and the model's TTFT
#: predictor; the plugin then picks SGLang's prefill batches with it. Unset: SGLang's own.
ENGINE_POLICY_VAR = "FINESLAB_ENGINE_POLICY"
#: "0": every runtime starts as a fresh interpreter instead of a fork of the launcher's zygote
#: (fineslab.zygote, warm starts; on by default).
ZYGOTE_VAR = "FINESLAB_ZYGOTE"
#: The socket of a zygote another process started and keeps (`fineslab.zygote.client.
#: serve_zygote`): runtimes whose environment it can take fork from it instead of from a
#: zygote of their launcher's own (the test suite starts one per test process, which every
#: fleet it launches shares). Unset: each launcher its own.
SHARED_ZYGOTE_VAR = "FINESLAB_SHARED_ZYGOTE"
#: "0": this runtime neither asks its neighbours for their prefix cache when the arena is short
#: nor gives its own back when they ask (the cache squeeze, fineslab.sglang_plugin.
#: cache_squeeze); on by default. The launcher sets it for a model with `cache_squeeze: false`.
CACHE_SQUEEZE_VAR = "FINESLAB_CACHE_SQUEEZE"
#: A file to append a JSON line to for each SGLang runtime, engine and Ray cluster started
#: (fineslab.startlog; the test suite sets it to count its starts). Unset: nothing written.
START_LOG_VAR = "FINESLAB_START_LOG"
#: FP8 KV only: the per-layer scales file (SGLang's `--quantization-param-path` JSON).
KV_SCALES_VAR = "FINESLAB_KV_SCALES"
#: The runtime contract (fineslab.slabs.contract): a JSON document the launcher writes for each
#: runtime holding its whole join and its planned KV block. Set, it is the join: the variables
#: above (but the arena and runtime id, which must agree with it) are not read.
CONTRACT_VAR = "FINESLAB_CONTRACT"


def _parse_tristate(name: str, raw: str | None) -> bool | None:
    if raw is None or raw == "":
        return None
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false or yes/no")


def _parse_slabs(name: str, raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise ConfigError(f"{name}={raw!r}: expected a whole number of slabs")
    return int(raw)


@dataclass(frozen=True)
class FineslabEnv:
    """A snapshot of the variables fineslab reads."""

    cpu_mode: bool | None
    model_cache_dir: str
    arena_name: str | None = None
    runtime_id: str | None = None
    key_pool: bool = False
    kv_format: str | None = None
    kv_scales_path: str | None = None
    weights_in_arena: bool = False
    layer_streaming: bool = False
    prefix_lending: int | None = None
    warm_starts: bool = True
    shared_zygote: str | None = None
    start_log: str | None = None
    contract_path: str | None = None
    cache_squeeze: bool = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> FineslabEnv:
        env = os.environ if environ is None else environ
        default_cache = os.path.join(os.path.expanduser("~"), ".cache", "fineslab", "models")
        return cls(
            cpu_mode=_parse_tristate(CPU_MODE_VAR, env.get(CPU_MODE_VAR)),
            model_cache_dir=env.get(MODEL_CACHE_VAR) or default_cache,
            arena_name=env.get(ARENA_VAR) or None,
            runtime_id=env.get(RUNTIME_ID_VAR) or None,
            key_pool=bool(_parse_tristate(KEY_POOL_VAR, env.get(KEY_POOL_VAR))),
            kv_format=env.get(KV_FORMAT_VAR) or None,
            kv_scales_path=env.get(KV_SCALES_VAR) or None,
            weights_in_arena=bool(_parse_tristate(WEIGHTS_IN_ARENA_VAR,
                                                  env.get(WEIGHTS_IN_ARENA_VAR))),
            layer_streaming=bool(_parse_tristate(LAYER_STREAMING_VAR,
                                                 env.get(LAYER_STREAMING_VAR))),
            prefix_lending=_parse_slabs(PREFIX_LENDING_VAR, env.get(PREFIX_LENDING_VAR)),
            warm_starts=_parse_tristate(ZYGOTE_VAR, env.get(ZYGOTE_VAR)) is not False,
            shared_zygote=env.get(SHARED_ZYGOTE_VAR) or None,
            start_log=env.get(START_LOG_VAR) or None,
            contract_path=env.get(CONTRACT_VAR) or None,
            cache_squeeze=_parse_tristate(CACHE_SQUEEZE_VAR, env.get(CACHE_SQUEEZE_VAR))
            is not False,
        )

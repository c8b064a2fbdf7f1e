"""Joining an arena with a fineslab-quantized KV format (KV4, or FP8 with scales on CPU).

SGLang has no 4-bit KV and (on CPU) no usable FP8 KV, so such a runtime runs with SGLang's
`--kv-cache-dtype auto` and the plugin swaps in the real storage format: it fits the arena with
an INT4 or FP8 block format, and hands SGLang a `Kv4SlabKVPool` / `Fp8SlabKVPool` over the views.

The request travels like the arena join, in the runtime's environment (names in fineslab.env):
    FINESLAB_KV_FORMAT   int4 | fp8_e4m3        (unset: SGLang's dtype, the stock SlabKVPool)
    FINESLAB_KV_SCALES   fp8 only: SGLang's `--quantization-param-path` JSON (per-layer scales);
                         unset: scales 1.0 and a warning (`fineslab.quant.fp8.kv_scales_or_warn`)

The one plugin entry point, `fineslab.sglang_plugin:register`, calls `install_quant` when
FINESLAB_KV_FORMAT is set. Everything else (allocator, capacity, refusals, leak check) is the
base session's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fineslab.env import KV_FORMAT_VAR, KV_SCALES_VAR, FineslabEnv
from fineslab.errors import ConfigError
from fineslab.sglang_plugin.config import ArenaJoin
from fineslab.sglang_plugin.hooks import PluginSession, kv_shape_of, refuse_model_kinds
from fineslab.sglang_plugin.install import install_session
from fineslab.sglang_plugin.link import arena_device
from fineslab.sglang_plugin.quant_pools import Fp8SlabKVPool, Kv4SlabKVPool
from fineslab.sglang_plugin.refusals import refuse_unsupported, settings_of
from fineslab.slabs.formats import KVDtype

logger = logging.getLogger(__name__)

_FORMATS = {"int4": KVDtype.INT4, "fp8_e4m3": KVDtype.FP8_E4M3}


@dataclass(frozen=True)
class KVFormatRequest:
    """The storage format a runtime asks for, and the FP8 scales file if any."""

    kv_dtype: KVDtype
    scales_path: str | None = None

    @classmethod
    def from_env(cls, env: FineslabEnv | None = None) -> KVFormatRequest | None:
        """The format in the environment, or None when the runtime keeps SGLang's KV dtype."""
        env = env or FineslabEnv.from_environ()
        if env.kv_format is None:
            return None
        if env.kv_format not in _FORMATS:
            raise ConfigError(
                f"{KV_FORMAT_VAR}={env.kv_format!r}: expected one of {sorted(_FORMATS)}")
        return cls(_FORMATS[env.kv_format], env.kv_scales_path)

    def environ(self) -> dict[str, str]:
        name = next(k for k, v in _FORMATS.items() if v is self.kv_dtype)
        env = {KV_FORMAT_VAR: name}
        if self.scales_path is not None:
            env[KV_SCALES_VAR] = self.scales_path
        return env


class QuantPluginSession(PluginSession):
    """A `PluginSession` whose block format and pool carry a quantized KV storage type."""

    def __init__(self, join: ArenaJoin, request: KVFormatRequest) -> None:
        super().__init__(join)
        self.request = request

    def profile_available_bytes(self, original: Callable[..., int], configurator: Any,
                                *args: Any, **kwargs: Any) -> int:
        refuse_unsupported(settings_of(configurator.server_args))
        refuse_model_kinds(configurator)
        model_shape = kv_shape_of(configurator, self.join.runtime_id)
        if model_shape.kv_dtype not in (KVDtype.BF16, KVDtype.FP16):
            raise ConfigError(f"{KV_FORMAT_VAR} needs SGLang's --kv-cache-dtype auto (bf16 or "
                              f"fp16 model), not {model_shape.kv_dtype.value}")
        shape = dataclasses.replace(model_shape, kv_dtype=self.request.kv_dtype)
        if self.link is None:
            device = arena_device(str(configurator.device), configurator.gpu_id)
            self.link = self._opener(self.join, shape, configurator.page_size, device)
        capacity_tokens = self.link.capacity_tokens
        logger.info("fineslab: runtime %r joined arena %r with %s KV: %d B a token, capacity "
                    "%d tokens", self.join.runtime_id, self.join.arena_name,
                    shape.kv_dtype.value, shape.token_bytes, capacity_tokens)
        # SGLang divides the budget by its own (model dtype) cell size.
        return capacity_tokens * model_shape.token_bytes

    def resolve_kv_pool_class(self, original: Callable[..., type], configurator: Any,
                              *args: Any, kind: str, default: type, **kwargs: Any) -> type:
        if kind != "mha":
            return original(configurator, *args, kind=kind, default=default, **kwargs)
        views = self._require_link().views
        if self.request.kv_dtype is KVDtype.INT4:
            return Kv4SlabKVPool.over(views)
        from fineslab.quant.fp8 import kv_scales_or_warn

        return Fp8SlabKVPool.with_scales(
            views, kv_scales_or_warn(self.request.scales_path, len(views)))


def install_quant(join: ArenaJoin, request: KVFormatRequest) -> QuantPluginSession:
    """Install the quantized-KV session's hooks in this process (the scheduler); raises
    EnvironmentSetupError if a contact point broke or SGLang does not apply a hook."""
    session = install_session(QuantPluginSession(join, request))
    logger.info("fineslab quant plugin: runtime %r keeps %s KV in arena %r", join.runtime_id,
                request.kv_dtype.value, join.arena_name)
    return session


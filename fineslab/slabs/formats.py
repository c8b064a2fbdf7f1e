"""KV block formats: how many bytes one token of one model takes, and how a block is laid out.

Glossary
    token_bytes         the real KV bytes of one token on one TP rank, all layers, K and V,
                        plus the quantization parameters stored with it (INT4 only).
    token_stride_bytes  the distance between two consecutive token slots in the arena:
                        token_bytes rounded up so that slab sizes stay small (padding).
    tokens_per_block    SGLang's page size for the model (`--page-size`).
    block_stride_bytes  tokens_per_block * token_stride_bytes: one engine block (page).
    padding waste       (token_stride_bytes - token_bytes) / token_stride_bytes.

Invariants
    token_bytes = num_layers * per_layer_bytes
    per_layer_bytes = 2 * kv_heads * head_dim * elem_bytes             (BF16, FP16, FP32, FP8)
    per_layer_bytes = 2 * kv_heads * head_dim / 2 + 2 * kv_heads * 4  (INT4, + scale/zero)
    token_bytes <= token_stride_bytes,  token_stride_bytes % alignment_bytes == 0
    block_stride_bytes = tokens_per_block * token_stride_bytes

FP8 (e4m3) keeps one scale per layer outside the block (SGLang's `k_scale`/`v_scale`), so its
block holds values only. INT4 (QoQ KV4) keeps a per-token, per-head fp16 (scale, zero) pair for K
and another for V inside the token, next to that layer's packed values; see `views.py` for the
byte layout.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from fineslab.errors import ConfigError

#: Every token stride is a multiple of this, so fp16/bf16 views are aligned and GPU loads of a
#: row start on a 16-byte boundary.
DEFAULT_ALIGNMENT_BYTES = 16


class KVDtype(enum.Enum):
    """The storage type of KV values; `value` is the name SGLang's `--kv-cache-dtype` uses.

    Three other spellings are in use, each read by `from_name`: the fleet config's (`bf16`,
    `fp8_e4m3`, `int4`: `config_name`), the profiles' (`fp8`: `profile_name`) and torch's
    (`torch.float8_e4m3fn`). This enum is the only place they are mapped.
    """

    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    INT4 = "int4"

    @property
    def value_bits(self) -> int:
        return _VALUE_BITS[self]

    @property
    def config_name(self) -> str:
        """The name in a fleet config's `kv_dtype` (bf16, fp16, fp32, fp8_e4m3, int4)."""
        return _CONFIG_NAMES[self]

    @property
    def profile_name(self) -> str:
        """The name in a profile's `kv_dtype` (bf16, fp16, fp32, fp8, int4)."""
        return "fp8" if self is KVDtype.FP8_E4M3 else self.config_name

    @classmethod
    def from_name(cls, name: str) -> KVDtype:
        """The KV dtype any of its spellings names; ConfigError listing them otherwise."""
        found = _BY_NAME.get(name.removeprefix("torch."))
        if found is None:
            raise ConfigError(f"unknown KV dtype {name!r}; known: {sorted(_BY_NAME)}")
        return found


_VALUE_BITS = {KVDtype.BF16: 16, KVDtype.FP16: 16, KVDtype.FP32: 32, KVDtype.FP8_E4M3: 8,
               KVDtype.INT4: 4}
_CONFIG_NAMES = {KVDtype.BF16: "bf16", KVDtype.FP16: "fp16", KVDtype.FP32: "fp32",
                 KVDtype.FP8_E4M3: "fp8_e4m3", KVDtype.INT4: "int4"}
_BY_NAME = {**{d.value: d for d in KVDtype}, **{n: d for d, n in _CONFIG_NAMES.items()},
            "fp8": KVDtype.FP8_E4M3, "float8_e4m3fn": KVDtype.FP8_E4M3}


#: Bytes of one (scale, zero) fp16 pair per head, for K or for V (INT4 only).
INT4_PARAM_BYTES_PER_HEAD = 2 * 2


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of one model replica on one TP rank, before any padding.

    `num_kv_heads` is the model's total; a TP shard holds `num_kv_heads / tp_size` of them (or one
    replicated head when `tp_size` exceeds the head count, as SGLang does).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: KVDtype
    tp_size: int = 1

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"{self.name}: {field_name} must be positive")
        if self.kv_dtype is KVDtype.INT4 and self.head_dim % 2:
            raise ConfigError(f"{self.name}: INT4 KV packs two values a byte; head_dim is odd")
        heads, tp = self.num_kv_heads, self.tp_size
        if heads % tp and tp % heads:
            raise ConfigError(f"{self.name}: {heads} KV heads cannot be split over TP={tp}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object], name: str, kv_dtype: KVDtype,
                       tp_size: int = 1) -> KVShape:
        """The KV geometry a Hugging Face `config.json` (parsed) describes; ConfigError naming
        a missing or non-integer field. `head_dim` defaults to hidden_size / heads and
        `num_key_value_heads` to the attention heads, as transformers does."""
        def field(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if value is None and default is not None:
                value = default
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name}: config.json field {key!r} is {value!r}, not an int")
            return value

        heads = field("num_attention_heads")
        return cls(name, field("num_hidden_layers"), field("num_key_value_heads", heads),
                   field("head_dim", field("hidden_size") // heads), kv_dtype, tp_size)

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def layer_values_bytes(self) -> int:
        """K or V values of one layer for one token (packed for INT4)."""
        return self.kv_heads_per_rank * self.head_dim * self.kv_dtype.value_bits // 8

    @property
    def layer_params_bytes(self) -> int:
        """K or V quantization parameters of one layer for one token (0 unless INT4)."""
        if self.kv_dtype is not KVDtype.INT4:
            return 0
        return self.kv_heads_per_rank * INT4_PARAM_BYTES_PER_HEAD

    @property
    def layer_bytes(self) -> int:
        return 2 * (self.layer_values_bytes + self.layer_params_bytes)

    @property
    def token_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


@dataclass(frozen=True)
class BlockFormat:
    """One model's block in the arena: its shape, its page size and its padded token stride."""

    shape: KVShape
    tokens_per_block: int
    token_stride_bytes: int

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise ConfigError(f"{self.shape.name}: tokens_per_block must be positive")
        if self.token_stride_bytes < self.shape.token_bytes:
            raise ConfigError(
                f"{self.shape.name}: token stride {self.token_stride_bytes} B is smaller than "
                f"the token's {self.shape.token_bytes} B")
        if self.token_stride_bytes % 2:
            raise ConfigError(f"{self.shape.name}: token stride must be even for 16-bit views")

    @classmethod
    def unpadded(cls, shape: KVShape, tokens_per_block: int) -> BlockFormat:
        """The format with no padding: stride = token_bytes (rounded to an even number)."""
        return cls(shape, tokens_per_block, shape.token_bytes + shape.token_bytes % 2)

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def token_bytes(self) -> int:
        return self.shape.token_bytes

    @property
    def block_stride_bytes(self) -> int:
        return self.tokens_per_block * self.token_stride_bytes

    @property
    def block_bytes(self) -> int:
        """Real KV bytes a full block holds (no padding)."""
        return self.tokens_per_block * self.token_bytes

    @property
    def padding_waste(self) -> float:
        """The fraction of each token stride that is padding, 0..1."""
        return 1.0 - self.token_bytes / self.token_stride_bytes

    def blocks_per_slab(self, slab_bytes: int) -> int:
        if slab_bytes % self.block_stride_bytes:
            raise ConfigError(
                f"{self.name}: slab of {slab_bytes} B is not a multiple of the block stride "
                f"{self.block_stride_bytes} B")
        return slab_bytes // self.block_stride_bytes

"""The runtime contract: what the launcher tells one runtime to be, in one versioned document.

The launcher writes one per runtime (`<log dir>/<runtime id>.contract.json`) and names it in the
runtime's environment (`FINESLAB_CONTRACT`); the plugin reads it at start (`ArenaJoin.from_env`)
and checks it at join, when SGLang has built its KV geometry: a runtime whose SGLang builds a
block other than the planned one (another model in the folder, another dtype, a page size the
plan did not give) fails there, with both shapes in the message, instead of carving slabs in a
format the rest of the arena does not expect. docs/plugin.md describes every field.

    version          CONTRACT_VERSION; a reader refuses any other
    arena            the arena's name (the fleet id)
    runtime_id       this replica's id in the slab table
    device           "cpu" or "cuda:N"
    key_pool         shares its block size's slabs with the device's other runtimes of that size
    weights_in_arena weights in weight slabs (elastic and streaming models)
    layer_streaming  each layer on slabs of its own, lendable (needs weights_in_arena)
    kv_format        a KV format the plugin's pools store ("int4", "fp8_e4m3"), or null
    kv_scales_path   FP8 KV only: the per-layer scales file
    prefix_lending   SwiftCache's lent tier: null = off, N = on with a cap of N lent slabs
    block            the planned block: layers, KV heads, head dim, KV dtype, tokens a block,
                     token stride (bytes); null when the plan has none to give
    files            the control files the launcher and this runtime share, by purpose
                     (weights_host_copy, stream_request, stream_state, step_scales: written
                     for operators and tools; the plugin derives the same paths itself)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fineslab.errors import ConfigError
from fineslab.jsonfile import write_json_whole
from fineslab.slabs.formats import BlockFormat

CONTRACT_VERSION = 1


@dataclass(frozen=True)
class PlannedBlock:
    """The KV block a runtime stores in the arena: its model's geometry and its padded layout."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    tokens_per_block: int
    token_stride_bytes: int

    @classmethod
    def of(cls, fmt: BlockFormat) -> PlannedBlock:
        shape = fmt.shape
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.kv_dtype.value,
                   fmt.tokens_per_block, fmt.token_stride_bytes)

    def check(self, built: BlockFormat, runtime_id: str) -> None:
        """ConfigError unless SGLang built this block, naming both."""
        actual = PlannedBlock.of(built)
        if actual != self:
            raise ConfigError(
                f"runtime {runtime_id}: SGLang built a KV block of {actual.describe()}, "
                f"but the plan is {self.describe()}; the model folder, --dtype, "
                "--kv-cache-dtype or --page-size differ from what the launcher planned")

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} "
                f"dims in {self.kv_dtype}, {self.tokens_per_block}-token blocks, "
                f"{self.token_stride_bytes} B a token")


@dataclass(frozen=True)
class RuntimeContract:
    arena: str
    runtime_id: str
    device: str
    key_pool: bool = False
    weights_in_arena: bool = False
    layer_streaming: bool = False
    kv_format: str | None = None
    kv_scales_path: str | None = None
    prefix_lending: int | None = None
    block: PlannedBlock | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    version: int = CONTRACT_VERSION

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["files"] = dict(self.files)
        return doc

    def write(self, path: Path) -> Path:
        """The document at `path`, written whole (a reader never sees half of it)."""
        write_json_whole(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, doc: object, source: str) -> RuntimeContract:
        """The contract in `doc`; ConfigError naming `source` and what is wrong."""
        if not isinstance(doc, dict):
            raise ConfigError(f"runtime contract {source}: not a JSON object")
        version = doc.get("version")
        if version != CONTRACT_VERSION:
            raise ConfigError(f"runtime contract {source}: version {version!r}, this fineslab "
                              f"reads version {CONTRACT_VERSION} (launcher and runtime from "
                              "different installs?)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise ConfigError(f"runtime contract {source}: unknown fields {unknown}")
        try:
            block = doc.get("block")
            planned = None if block is None else PlannedBlock(**block)
            contract = cls(**{**doc, "block": planned, "files": dict(doc.get("files") or {})})
        except TypeError as exc:
            raise ConfigError(f"runtime contract {source}: {exc}") from None
        for name in ("arena", "runtime_id", "device"):
            if not isinstance(getattr(contract, name), str) or not getattr(contract, name):
                raise ConfigError(f"runtime contract {source}: {name} must be a non-empty string")
        return contract

    @classmethod
    def read(cls, path: str | Path) -> RuntimeContract:
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"runtime contract {path}: cannot read it ({exc.strerror})"
                              ) from None
        except ValueError as exc:
            raise ConfigError(f"runtime contract {path}: not JSON ({exc})") from None
        return cls.from_dict(doc, str(path))

    def check_block(self, built: BlockFormat) -> None:
        """ConfigError unless SGLang built the planned block (nothing planned: nothing to
        check)."""
        if self.block is not None:
            self.block.check(built, self.runtime_id)

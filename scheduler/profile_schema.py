"""The profile of one model x precision x device: the schema, the loader and the writer.

A profile is a JSON file in `profiles/`, named `<model>--<precision>--<device>.json`. Every
size is per TP rank (what one GPU holds) except the MME curve's x axis, which is the KV bytes
of the whole replica (all ranks), because contested memory is summed over a TP group.

    schema_version   1
    source           "measured" (python -m fineslab.profile measure) or "analytical" (roofline)
    model, precision, device, tp, kv_dtype
    shape            {num_layers, hidden_size, num_heads, num_kv_heads, head_dim,
                      intermediate_size, vocab_size, num_params}
    weights_bytes    weights on one rank
    kv_token_bytes   KV bytes per token on one rank (scheduler.kv_format)
    device_memory_bytes  memory of the device the profile is for
    chunk_tokens     chunked-prefill chunk size the prefill curve is read with
    workload         {prompt_tokens, output_tokens}: the mean request the tables assume
    activation_bytes [[batch_size, bytes], ...]     peak activation memory of one step
    prefill_s        [[batched_tokens, seconds], ...] one prefill step of that many tokens
    decode           {batch_sizes: [...], context_tokens: [...], seconds: [[...], ...]}
                     decode step latency, rows by batch size, columns by context length
    throughput_tokens_per_s [[batch_size, tokens/s], ...] generated tokens/s at that batch
    mme              [[kv_bytes, tokens/s], ...] generated tokens/s a KV pool of that size
                     sustains; its slope is the marginal memory efficiency mu
    provenance       {command, created, ...} free-form strings

Loading validates everything (a `ConfigError` names the file and the field) so that a policy
can trust a `ModelProfile` without checks of its own.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fineslab.scheduler.curves import PiecewiseLinear

from fineslab.errors import ConfigError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SOURCES = ("measured", "analytical")


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the formulas need (from the model's config.json)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int


@dataclass(frozen=True)
class Workload:
    """The mean request a profile's throughput and MME tables assume."""

    prompt_tokens: int
    output_tokens: int

    @property
    def mean_context_tokens(self) -> float:
        """Average context of a running request: the prompt plus half its output."""
        return self.prompt_tokens + self.output_tokens / 2


@dataclass(frozen=True)
class DecodeTable:
    """Decode step latency by batch size x context length, read bilinearly: each batch size's
    row is read at the context, then the column across batch sizes at the batch.

    The row curves are built once, on construction (`_rows`, not part of equality), and a
    reading evaluates only the two rows around the batch size: the column curve interpolates
    between those two (or extends the outer pair), so the answer is bit for bit the one of
    building every row and the column per call, which made `step_s` about 75% of the
    simulator's time.
    """

    batch_sizes: tuple[int, ...]
    context_tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    _rows: tuple[PiecewiseLinear, ...] = field(init=False, repr=False, compare=False)
    _batch_xs: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.batch_sizes) or any(
            len(row) != len(self.context_tokens) for row in self.seconds
        ):
            raise ConfigError("decode.seconds must have one row per batch size and one "
                              "column per context length")
        # Each curve validates that its axis is increasing and finite.
        ctx = tuple(float(c) for c in self.context_tokens)
        object.__setattr__(self, "_rows",
                           tuple(PiecewiseLinear(ctx, tuple(row)) for row in self.seconds))
        batch_xs = tuple(float(b) for b in self.batch_sizes)
        PiecewiseLinear(batch_xs, tuple(0.0 for _ in batch_xs))  # validates the batch axis
        object.__setattr__(self, "_batch_xs", batch_xs)

    def step_s(self, batch_size: float, context_tokens: float) -> float:
        """Seconds of one decode step of `batch_size` requests at `context_tokens` each."""
        xs, rows = self._batch_xs, self._rows
        if len(xs) == 1:
            return rows[0](context_tokens)
        # PiecewiseLinear.__call__ on the column, reading only the two rows it uses.
        i = min(max(bisect.bisect_right(xs, batch_size), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = rows[i - 1](context_tokens), rows[i](context_tokens)
        return max(0.0, y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0))


@dataclass(frozen=True)
class ModelProfile:
    """Everything the placer and the local scheduler know about one model on one device."""

    source: str
    model: str
    precision: str
    device: str
    tp: int
    kv_dtype: str
    shape: ModelShape
    weights_bytes: int
    kv_token_bytes: int
    device_memory_bytes: int
    chunk_tokens: int
    workload: Workload
    activation_bytes: PiecewiseLinear
    prefill_s: PiecewiseLinear
    decode: DecodeTable
    throughput_tokens_per_s: PiecewiseLinear
    mme: PiecewiseLinear
    provenance: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"profile source must be one of {SOURCES}, got {self.source!r}")
        if min(self.tp, self.weights_bytes, self.kv_token_bytes, self.chunk_tokens) < 1:
            raise ConfigError(f"profile {self.name}: tp, weights_bytes, kv_token_bytes and "
                              "chunk_tokens must be positive")
        if not self.prefill_s.is_non_decreasing():
            raise ConfigError(f"profile {self.name}: prefill_s must not decrease with tokens")

    @property
    def name(self) -> str:
        return profile_name(self.model, self.precision, self.device)


def profile_name(model: str, precision: str, device: str) -> str:
    return f"{model}--{precision}--{device}".lower()


def profile_to_dict(profile: ModelProfile) -> dict[str, Any]:
    """The JSON form (see the module docstring)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "source": profile.source, "model": profile.model, "precision": profile.precision,
        "device": profile.device, "tp": profile.tp, "kv_dtype": profile.kv_dtype,
        "shape": asdict(profile.shape),
        "weights_bytes": profile.weights_bytes, "kv_token_bytes": profile.kv_token_bytes,
        "device_memory_bytes": profile.device_memory_bytes,
        "chunk_tokens": profile.chunk_tokens, "workload": asdict(profile.workload),
        "activation_bytes": profile.activation_bytes.points(),
        "prefill_s": profile.prefill_s.points(),
        "decode": {"batch_sizes": list(profile.decode.batch_sizes),
                   "context_tokens": list(profile.decode.context_tokens),
                   "seconds": [list(r) for r in profile.decode.seconds]},
        "throughput_tokens_per_s": profile.throughput_tokens_per_s.points(),
        "mme": profile.mme.points(),
        "provenance": dict(profile.provenance),
    }


def profile_from_dict(data: Mapping[str, Any], where: str = "<dict>") -> ModelProfile:
    """Parse and validate; every problem becomes a `ConfigError` naming `where`."""
    try:
        if data["schema_version"] != SCHEMA_VERSION:
            raise ConfigError(f"schema_version {data['schema_version']} is not "
                              f"{SCHEMA_VERSION}; regenerate the profile")
        decode = data["decode"]
        return ModelProfile(
            source=data["source"], model=data["model"], precision=data["precision"],
            device=data["device"], tp=int(data["tp"]), kv_dtype=data["kv_dtype"],
            shape=ModelShape(**{k: int(v) for k, v in data["shape"].items()}),
            weights_bytes=int(data["weights_bytes"]),
            kv_token_bytes=int(data["kv_token_bytes"]),
            device_memory_bytes=int(data["device_memory_bytes"]),
            chunk_tokens=int(data["chunk_tokens"]),
            workload=Workload(**{k: int(v) for k, v in data["workload"].items()}),
            activation_bytes=PiecewiseLinear.from_points(data["activation_bytes"]),
            prefill_s=PiecewiseLinear.from_points(data["prefill_s"]),
            decode=DecodeTable(tuple(int(b) for b in decode["batch_sizes"]),
                               tuple(int(c) for c in decode["context_tokens"]),
                               tuple(tuple(float(s) for s in row) for row in decode["seconds"])),
            throughput_tokens_per_s=PiecewiseLinear.from_points(data["throughput_tokens_per_s"]),
            mme=PiecewiseLinear.from_points(data["mme"]),
            provenance={str(k): str(v) for k, v in data.get("provenance", {}).items()},
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: malformed profile ({type(exc).__name__}: {exc})") from exc


def save_profile(profile: ModelProfile, directory: Path) -> Path:
    """Write `<directory>/<name>.json` (stable key order, so regeneration diffs cleanly)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{profile.name}.json"
    path.write_text(json.dumps(profile_to_dict(profile), indent=1, sort_keys=True) + "\n")
    return path


def load_profile(path: Path) -> ModelProfile:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read profile {path}: {exc}") from exc
    return profile_from_dict(data, where=str(path))


def load_profiles(directory: Path) -> dict[str, ModelProfile]:
    """Every `*.json` profile in `directory`, by name."""
    profiles = {}
    for path in sorted(directory.glob("*.json")):
        profile = load_profile(path)
        profiles[profile.name] = profile
    logger.debug("loaded %d profiles from %s", len(profiles), directory)
    return profiles

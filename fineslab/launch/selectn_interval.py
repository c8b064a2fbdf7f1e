"""Select-N's interval from the SLO, at plan time (`layer_streaming: {policy: selectn,
interval: auto, tpot_slo_s: S}`; paper 001, section 4.4; the equations are scheduler/selectn.py's).

The plan knows the model's profile (prefill seconds by tokens, decode seconds by batch and
context) and its checkpoint; from them, per model:

    L        the checkpoint's decoder layers (config.json)
    W_l      the largest decoder layer's weight bytes (safetensors headers: tensors named
             `*.layers.<j>.*`)
    T_T      W_l / host link bytes/s (`host_link_gib_s`, else DEFAULT_LINK_GIB_S of the kind)
    T_c      prefill: profile.prefill_s(P) / L at one request of the profile's prompt length P
             (the TTFT a lone request sees); decode: profile.decode.step_s(B, C) / L at the
             model's max_running_requests B and the profile's mean context C (the largest
             batch: a conservative lookup, selectn.py's invariants)
    i        LayerCosts.smallest_interval(...) against (ttft_slo_s, tpot_slo_s): equation (5)
             for both phases at once

When no interval of 2..L meets both SLOs but all layers resident does, i = 0: nothing streams
(the paper's answer), logged as a warning. When not even that meets them, the model misses its
SLO with or without streaming (the placement's business, not this module's): i = 0 as well,
with the predicted times in the warning. Cost: one read of each safetensors header per model.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.launch.config import FleetConfig, ModelConfig
from fineslab.quant.verify import DTYPE_BYTES, read_headers
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.scheduler.selectn import (
    LayerCosts,
    most_conservative,
    offload_layers,
    smallest_interval,
)

logger = logging.getLogger(__name__)

GIB = 1 << 30
#: Host-copy -> weight-slot copies on CPU measured 10-16 GiB/s here (docs/streaming.md); 8 is
#: below both, so an interval sized for it holds on a busier machine. GPU kinds have no default:
#: the link differs by bus (PCIe 4 or 5, NVLink-C2C), so the config names it.
DEFAULT_LINK_GIB_S = {"cpu": 8.0}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class IntervalChoice:
    """What `choose_interval` decided, with the figures it decided on."""

    model: str
    interval: int  # 0: nothing streams
    layers: tuple[int, ...]
    layer_bytes: int
    layer_transfer_s: float
    ttft_s: float  # predicted at `interval`
    tpot_s: float
    ttft_slo_s: float
    tpot_slo_s: float

    @property
    def meets_slo(self) -> bool:
        return self.ttft_s <= self.ttft_slo_s and self.tpot_s <= self.tpot_slo_s

    def describe(self) -> str:
        return (f"{self.model}: selectn interval {self.interval} (layers "
                f"{list(self.layers)}), predicted TTFT {self.ttft_s:.3g} s (SLO "
                f"{self.ttft_slo_s:g}), TPOT {self.tpot_s:.3g} s (SLO {self.tpot_slo_s:g}); "
                f"a layer {self.layer_bytes} B, {self.layer_transfer_s * 1e3:.3g} ms to copy")


def decoder_layer_bytes(model_dir: Path) -> int:
    """The largest decoder layer's weight bytes, from the safetensors headers."""
    per_layer: dict[int, int] = {}
    for name, info in read_headers(model_dir).items():
        match = _LAYER.search(name)
        if match is None:
            continue
        if info.dtype not in DTYPE_BYTES:
            raise ConfigError(f"checkpoint {model_dir}: tensor {name} has dtype {info.dtype}, "
                              "which selectn's interval sizing does not know")
        index = int(match.group(1))
        per_layer[index] = per_layer.get(index, 0) + info.num_elements * DTYPE_BYTES[info.dtype]
    if not per_layer:
        raise ConfigError(f"checkpoint {model_dir}: no tensor named `*.layers.<j>.*`: "
                          "selectn cannot size a layer")
    return max(per_layer.values())


def choose_interval(model: ModelConfig, profile: ModelProfile, model_dir: Path,
                    device_kind: str, max_running: int) -> IntervalChoice:
    """Equation (5) for `model` (an `interval: auto` selectn model) on a device of
    `device_kind`, from its profile and checkpoint (module docstring)."""
    streaming = model.layer_streaming
    if streaming is None or streaming.tpot_slo_s is None:
        raise ConfigError(f"model {model.name}: interval: auto needs tpot_slo_s")
    link_gib_s = streaming.host_link_gib_s or DEFAULT_LINK_GIB_S.get(device_kind)
    if link_gib_s is None:
        raise ConfigError(f"model {model.name}: give layer_streaming.host_link_gib_s (the "
                          f"host -> device copy bandwidth of a {device_kind} device, GiB/s): "
                          "interval: auto sizes the interval for it")
    num_layers = profile.shape.num_layers
    workload = profile.workload
    costs = LayerCosts.on_link(
        num_layers, decoder_layer_bytes(model_dir), link_gib_s * GIB,
        prefill=lambda batch, seq_len: profile.prefill_s(batch * seq_len) / num_layers,
        decode=lambda batch, context: profile.decode.step_s(batch, context) / num_layers)
    prefill_at = (1, workload.prompt_tokens)
    decode_at = (max_running, round(workload.mean_context_tokens))
    ttft_slo_s, tpot_slo_s = model.ttft_slo_s, streaming.tpot_slo_s
    prefill = smallest_interval(num_layers, costs.layer_transfer_s,
                                costs.prefill_layer_s(*prefill_at), ttft_slo_s)
    decode = smallest_interval(num_layers, costs.layer_transfer_s,
                               costs.decode_layer_s(*decode_at), tpot_slo_s)
    interval = _both(prefill, decode)
    choice = IntervalChoice(
        model.name, interval, tuple(offload_layers(num_layers, interval)), costs.layer_bytes,
        costs.layer_transfer_s, costs.ttft_s(interval, *prefill_at),
        costs.tpot_s(interval, *decode_at), ttft_slo_s, tpot_slo_s)
    if interval == 0:
        logger.warning("%s: nothing streams (%s)", choice.describe(),
                       "no interval of 2..L meets both SLOs" if choice.meets_slo else
                       "the SLO is missed even with every layer resident")
    return choice


def _both(prefill: int | None, decode: int | None) -> int:
    """One interval for both phases: the more conservative of the two (0 ranks above every
    interval); 0 when either phase misses even with every layer resident."""
    return most_conservative(prefill, decode) or 0


def resolve_intervals(config: FleetConfig, profiles: dict[str, ModelProfile],
                      model_dirs: dict[str, Path], device_kind: str
                      ) -> tuple[FleetConfig, dict[str, IntervalChoice]]:
    """`config` with every `interval: auto` replaced by the chosen interval, and the choices
    by model name (logged at info)."""
    choices: dict[str, IntervalChoice] = {}
    models = []
    for model in config.models:
        streaming = model.layer_streaming
        if streaming is not None and streaming.auto:
            max_running = model.max_running_requests or config.router.max_running_requests
            choice = choose_interval(model, profiles[model.name], model_dirs[model.name],
                                     device_kind, max_running)
            choices[model.name] = choice
            logger.info("%s", choice.describe())
            model = replace(model, layer_streaming=replace(streaming, interval=choice.interval))
        models.append(model)
    return replace(config, models=tuple(models)), choices

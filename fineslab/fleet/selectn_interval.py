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
from dataclasses import dataclass
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.fleet.config import FleetConfig, ModelConfig
from fineslab.quant.verify import DTYPE_BYTES, read_headers
from fineslab.scheduler.profile_schema import ModelProfile
from fineslab.scheduler.selectn import (
    LayerCosts,
    LinkCoordinator,
    LinkRuntime,
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


@dataclass(frozen=True)
class _Sizing:
    """What equation (5) is evaluated on for one model: its costs, the link, the two points."""

    costs: LayerCosts
    link_bytes_per_s: float
    prefill_at: tuple[int, int]
    decode_at: tuple[int, int]
    ttft_slo_s: float
    tpot_slo_s: float

    def choice(self, model: str, interval: int) -> IntervalChoice:
        costs = self.costs
        return IntervalChoice(
            model, interval, tuple(offload_layers(costs.num_layers, interval)),
            costs.layer_bytes, costs.layer_transfer_s, costs.ttft_s(interval, *self.prefill_at),
            costs.tpot_s(interval, *self.decode_at), self.ttft_slo_s, self.tpot_slo_s)


def _sizing(model: ModelConfig, profile: ModelProfile, model_dir: Path, device_kind: str,
            max_running: int) -> _Sizing:
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
    return _Sizing(costs, link_gib_s * GIB, (1, workload.prompt_tokens),
                   (max_running, round(workload.mean_context_tokens)), model.ttft_slo_s,
                   streaming.tpot_slo_s)


def choose_interval(model: ModelConfig, profile: ModelProfile, model_dir: Path,
                    device_kind: str, max_running: int) -> IntervalChoice:
    """Equation (5) for `model` (an `interval: auto` selectn model) on a device of
    `device_kind`, from its profile and checkpoint (module docstring)."""
    return _choose(model, _sizing(model, profile, model_dir, device_kind, max_running))


def _choose(model: ModelConfig, sizing: _Sizing) -> IntervalChoice:
    costs = sizing.costs
    prefill = smallest_interval(costs.num_layers, costs.layer_transfer_s,
                                costs.prefill_layer_s(*sizing.prefill_at), sizing.ttft_slo_s)
    decode = smallest_interval(costs.num_layers, costs.layer_transfer_s,
                               costs.decode_layer_s(*sizing.decode_at), sizing.tpot_slo_s)
    choice = sizing.choice(model.name, _both(prefill, decode))
    if choice.interval == 0:
        logger.warning("%s: nothing streams (%s)", choice.describe(),
                       "no interval of 2..L meets both SLOs" if choice.meets_slo else
                       "the SLO is missed even with every layer resident")
    return choice


def coordinate_link(choices: dict[str, IntervalChoice], sizings: dict[str, _Sizing]
                    ) -> dict[str, IntervalChoice]:
    """The intervals of models whose streams share one host link, by the per-link coordinator
    (scheduler/selectn.py `LinkCoordinator`, paper 001 section 4.5, for n runtimes): each
    model's interval no smaller than its own choice (its TTFT holds), their copies' bytes/s
    within the link, host memory used the largest. Each alone predicts with the whole link;
    together their streams must share it. Models streaming nothing stay out. When no set fits
    (not expected: every model meets its TPOT with nothing streamed, or it would not stream),
    every one of them streams nothing, with a warning."""
    streaming = {name: c for name, c in choices.items() if c.interval >= 2}
    if len(streaming) < 2:
        return choices
    link = min(sizings[name].link_bytes_per_s for name in streaming)
    runtimes = [LinkRuntime(name, sizings[name].costs.num_layers, c.layer_bytes,
                            sizings[name].costs.decode_layer_s(*sizings[name].decode_at),
                            c.tpot_slo_s, min_interval=c.interval)
                for name, c in streaming.items()]
    coordinator = LinkCoordinator(link)
    plan = coordinator.plan(runtimes)
    intervals = plan.intervals if plan is not None else {name: 0 for name in streaming}
    if plan is None:
        logger.warning("select-n link: no intervals of %s fit the host link of %.3g GiB/s "
                       "together; none of them streams", sorted(streaming), link / GIB)
    else:
        logger.info("select-n link: %s share %.3g GiB/s: intervals %s, their copies %.3g GiB/s,"
                    " %d B in host memory", sorted(streaming), link / GIB, plan.intervals,
                    plan.stream_bytes_per_s / GIB, plan.host_bytes)
    out = dict(choices)
    for name, interval in intervals.items():
        if interval != choices[name].interval:
            out[name] = sizings[name].choice(name, interval)
    return out


def _both(prefill: int | None, decode: int | None) -> int:
    """One interval for both phases: the more conservative of the two (0 ranks above every
    interval); 0 when either phase misses even with every layer resident."""
    return most_conservative(prefill, decode) or 0


def resolve_intervals(config: FleetConfig, profiles: dict[str, ModelProfile],
                      model_dirs: dict[str, Path], device_kind: str
                      ) -> tuple[FleetConfig, dict[str, IntervalChoice]]:
    """`config` with every `interval: auto` replaced by the chosen interval, and the choices
    by model name (logged at info). On CPU every runtime's copies cross one memory bus, so the
    auto models' intervals are coordinated over it (`coordinate_link`); a GPU has a link of
    its own, and which models share it is known only after placement (not coordinated yet)."""
    choices: dict[str, IntervalChoice] = {}
    sizings: dict[str, _Sizing] = {}
    for model in config.models:
        streaming = model.layer_streaming
        if streaming is not None and streaming.auto:
            max_running = model.max_running_requests or config.router.max_running_requests
            sizings[model.name] = _sizing(model, profiles[model.name], model_dirs[model.name],
                                          device_kind, max_running)
            choices[model.name] = _choose(model, sizings[model.name])
    if device_kind == "cpu":
        choices = coordinate_link(choices, sizings)
    models = []
    for model in config.models:
        streaming = model.layer_streaming
        if model.name in choices and streaming is not None:
            logger.info("%s", choices[model.name].describe())
            model = model.model_copy(update={
                "layer_streaming": streaming.resolved(choices[model.name].interval)})
        models.append(model)
    return config.with_models(models), choices

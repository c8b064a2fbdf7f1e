"""Select-N's SLO sweep (issue #17 item 3): interval and host memory per SLO, beside paper 001.

Machine and model are the paper's (sections 3 and 5.1): an NVIDIA A10 (24 GiB, 600 GB/s,
125 TFLOPS dense FP16) on PCIe at 24 GB/s; OPT-6.7B in FP16. The paper measures T_c and T_T;
here T_c is the roofline of one decoder layer (scheduler.roofline's efficiencies, without its
per-step overhead: T_c is one layer's kernels) and T_T = layer bytes / 24 GB/s.

    decode   batch 128, sequence 64 (section 5.4, fig. 11b): TPOT SLO = (1 + delta) x t(0)
    prefill  batch 16, sequence 64 (fig. 11a): TTFT SLO = (1 + delta) x t(0)
    ratio    T_T / T_c of Qwen2-beta-7B at batch 4, sequence 256 (fig. 2b)
    link     OPT-13B and Llama-2-13B on one link, TPOT 100 ms, sequence 64, batch 8/16/32
             (section 5.5); GPU memory for layers = 95% of 24 GiB - embeddings - KV of
             batch x 128 tokens, which bounds each model's interval (`max_interval`)

delta is the paper's "SLO quotient" over the step without offloading, t(0) = L x T_c.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from fineslab.scheduler.devices import GIB, DeviceSpec
from fineslab.scheduler.profile_schema import ModelShape
from fineslab.scheduler.roofline import PRECISIONS, STEP_OVERHEAD_S, Roofline
from fineslab.scheduler.selectn import (
    LayerCosts,
    LinkCoordinator,
    LinkRuntime,
    footprint_bytes,
    num_offloaded,
    paper_interval_estimate,
    smallest_interval,
    step_time_s,
)

from fineslab.sim.experiments.report import markdown_table, write_report

logger = logging.getLogger(__name__)

A10 = DeviceSpec("a10", 125.0, None, 250.0, 600e9, 24 * GIB)
PCIE_BYTES_PER_S = 24e9
DELTAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0)
QUICK_DELTAS = (0.2, 0.5, 1.0)
#: Paper 001's reported points: fig. 11 (delta 0.5) and fig. 2b (T_T / T_c).
PAPER = {"decode_interval": 8, "prefill_interval": 3, "prefill_ratio": 3.5,
         "decode_ratio": 13.8}


@dataclass(frozen=True)
class PaperModel:
    """A model of paper 001, from its config.json: what one decoder layer needs."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    ffn: int
    gated: bool  # three MLP matrices (Llama, Qwen) or two (OPT)
    vocab: int

    @property
    def layer_params(self) -> int:
        return 4 * self.hidden ** 2 + (3 if self.gated else 2) * self.hidden * self.ffn

    @property
    def layer_bytes(self) -> int:
        return 2 * self.layer_params  # FP16

    @property
    def non_layer_bytes(self) -> int:
        return 2 * 2 * self.vocab * self.hidden  # embedding and head, counted untied

    def one_layer(self) -> Roofline:
        head_dim = self.hidden // self.heads
        shape = ModelShape(1, self.hidden, self.heads, self.heads, head_dim, self.ffn, 0,
                           self.layer_params)
        return Roofline(shape, PRECISIONS["fp16"], A10, tp=1)

    def costs(self) -> LayerCosts:
        layer = self.one_layer()
        return LayerCosts.on_link(
            self.num_layers, self.layer_bytes, PCIE_BYTES_PER_S,
            prefill=lambda b, s: layer.step_s(b * s, s / 2, prefill=True) - STEP_OVERHEAD_S,
            decode=lambda b, s: layer.step_s(b, s) - STEP_OVERHEAD_S)


OPT_6_7B = PaperModel("OPT-6.7B", 32, 4096, 32, 16384, False, 50272)
OPT_13B = PaperModel("OPT-13B", 40, 5120, 40, 20480, False, 50272)
LLAMA2_13B = PaperModel("Llama-2-13B", 40, 5120, 40, 13824, True, 32000)
QWEN2_BETA_7B = PaperModel("Qwen2-beta-7B", 32, 4096, 32, 11008, True, 151936)


@dataclass(frozen=True)
class SelectNExpConfig:
    out_dir: Path
    quick: bool = False
    memory_fraction: float = 0.95


@dataclass(frozen=True)
class SweepPoint:
    """One SLO of a sweep: the interval (eq. 5), its latency and host bytes, and eq. (6)."""

    delta: float
    slo_s: float
    interval: int | None  # None: the SLO is missed even with every layer resident
    latency_s: float
    layers_offloaded: int
    host_bytes: int
    weight_bytes: int
    closed_form: int
    closed_form_latency_s: float

    def row(self) -> list[object]:
        return [self.delta, round(self.slo_s * 1e3, 2), self.interval,
                round(self.latency_s * 1e3, 2), round(self.latency_s / self.slo_s, 3),
                self.layers_offloaded, round(self.host_bytes / GIB, 2),
                f"{self.host_bytes / self.weight_bytes:.0%}", self.closed_form,
                round(self.closed_form_latency_s / self.slo_s, 3)]


def sweep(model: PaperModel, phase: str, batch: int, seq_len: int,
          deltas: tuple[float, ...]) -> list[SweepPoint]:
    """One point per delta, SLO = (1 + delta) x t(0) of the phase at (batch, seq_len)."""
    costs = model.costs()
    compute_s = (costs.prefill_layer_s if phase == "prefill" else costs.decode_layer_s)(
        batch, seq_len)
    num_layers, transfer_s = model.num_layers, costs.layer_transfer_s
    points = []
    for delta in deltas:
        slo_s = (1 + delta) * step_time_s(num_layers, 0, transfer_s, compute_s)
        interval = smallest_interval(num_layers, transfer_s, compute_s, slo_s)
        chosen = interval if interval is not None else 0
        closed = paper_interval_estimate(num_layers, transfer_s, compute_s, delta)
        # Interval 1 streams every layer (refused by offload_layers): L (T_c + T_T).
        closed_s = (num_layers * (compute_s + transfer_s) if closed == 1
                    else step_time_s(num_layers, closed, transfer_s, compute_s))
        offloaded = num_offloaded(num_layers, chosen)
        points.append(SweepPoint(delta, slo_s, interval,
                                 step_time_s(num_layers, chosen, transfer_s, compute_s),
                                 offloaded, offloaded * model.layer_bytes,
                                 num_layers * model.layer_bytes, closed, closed_s))
    return points


def max_interval(model: PaperModel, batch: int, cfg: SelectNExpConfig) -> int | None:
    """The largest interval whose layer footprint fits the GPU (None: all fit; 2 is tried
    last, and a model that fits at none is given 2 and reported)."""
    kv_bytes = batch * 128 * model.num_layers * 2 * model.hidden * 2
    budget = cfg.memory_fraction * A10.memory_bytes - model.non_layer_bytes - kv_bytes
    weights = model.num_layers * model.layer_bytes
    if footprint_bytes(weights, 0) <= budget:
        return None
    fitting = [i for i in range(2, model.num_layers + 1)
               if footprint_bytes(weights, i, num_layers=model.num_layers) <= budget]
    return max(fitting) if fitting else 2


def link_rows(cfg: SelectNExpConfig) -> list[list[object]]:
    link = LinkCoordinator(PCIE_BYTES_PER_S)
    rows: list[list[object]] = []
    for batch in (8, 16, 32):
        runtimes = [LinkRuntime(m.name, m.num_layers, m.layer_bytes,
                                m.costs().decode_layer_s(batch, 64), 0.100,
                                max_interval(m, batch, cfg)) for m in (OPT_13B, LLAMA2_13B)]
        slo_min = [smallest_interval(r.num_layers, r.layer_bytes / PCIE_BYTES_PER_S,
                                     r.layer_compute_s, r.tpot_slo_s) for r in runtimes]
        copy_ms = [num_offloaded(r.num_layers, r.max_interval or 0) * r.layer_bytes
                   / PCIE_BYTES_PER_S * 1e3 for r in runtimes]
        plan = link.plan(runtimes)
        rows.append([batch, " / ".join(str(r.max_interval) for r in runtimes),
                     " / ".join(str(i) for i in slo_min),
                     " / ".join(f"{ms:.0f}" for ms in copy_ms),
                     " / ".join(str(plan.intervals[r.name]) for r in runtimes) if plan
                     else "refused",
                     round(plan.host_bytes / GIB, 2) if plan else "-",
                     round(plan.stream_bytes_per_s / 1e9, 1) if plan else "-"])
    return rows


def ratio(model: PaperModel, phase: str, batch: int, seq_len: int) -> float:
    costs = model.costs()
    layer_s = costs.prefill_layer_s if phase == "prefill" else costs.decode_layer_s
    return costs.layer_transfer_s / layer_s(batch, seq_len)


def run_selectn(cfg: SelectNExpConfig) -> tuple[dict[str, float], str]:
    deltas = QUICK_DELTAS if cfg.quick else DELTAS
    decode = sweep(OPT_6_7B, "decode", 128, 64, deltas)
    prefill = sweep(OPT_6_7B, "prefill", 16, 64, deltas)
    (decode_half,) = sweep(OPT_6_7B, "decode", 128, 64, (0.5,))
    (prefill_half,) = sweep(OPT_6_7B, "prefill", 16, 64, (0.5,))
    links = link_rows(cfg)
    acceptance: dict[str, float] = {
        "decode_interval_d0.5": float(decode_half.interval or 0),
        "prefill_interval_d0.5": float(prefill_half.interval or 0),
        "paper_decode_interval_d0.5": float(PAPER["decode_interval"]),
        "paper_prefill_interval_d0.5": float(PAPER["prefill_interval"]),
        "closed_form_decode_interval_d0.5": float(decode_half.closed_form),
        "closed_form_prefill_interval_d0.5": float(prefill_half.closed_form),
        "decode_host_gib_d0.5": decode_half.host_bytes / GIB,
        "max_latency_over_slo": max(p.latency_s / p.slo_s for p in decode + prefill),
        "qwen_prefill_transfer_over_compute": ratio(QWEN2_BETA_7B, "prefill", 4, 256),
        "qwen_decode_transfer_over_compute": ratio(QWEN2_BETA_7B, "decode", 4, 256),
        "link_points_admitted": float(sum(r[4] != "refused" for r in links)),
    }
    text = _text(decode, prefill, links, acceptance)
    write_report(cfg.out_dir, "selectn", _body(cfg, text, acceptance))
    return acceptance, text


SWEEP_HEADERS = ["delta", "SLO ms", "interval (5)", "latency ms", "latency/SLO",
                 "layers offloaded", "host GiB", "host share", "closed form (6)",
                 "(6) latency/SLO"]


def _text(decode: list[SweepPoint], prefill: list[SweepPoint], links: list[list[object]],
          acc: dict[str, float]) -> str:
    beside = [
        ["decode interval, delta 0.5 (fig. 11b)", acc["decode_interval_d0.5"],
         acc["closed_form_decode_interval_d0.5"], PAPER["decode_interval"]],
        ["prefill interval, delta 0.5 (fig. 11a)", acc["prefill_interval_d0.5"],
         acc["closed_form_prefill_interval_d0.5"], PAPER["prefill_interval"]],
        ["Qwen2-beta-7B T_T/T_c prefill (fig. 2b)",
         round(acc["qwen_prefill_transfer_over_compute"], 1), "-", PAPER["prefill_ratio"]],
        ["Qwen2-beta-7B T_T/T_c decode (fig. 2b)",
         round(acc["qwen_decode_transfer_over_compute"], 1), "-", PAPER["decode_ratio"]],
    ]
    return "\n\n".join([
        "### OPT-6.7B decode, batch 128, sequence 64 (TPOT)",
        markdown_table(SWEEP_HEADERS, [p.row() for p in decode]),
        "### OPT-6.7B prefill, batch 16, sequence 64 (TTFT)",
        markdown_table(SWEEP_HEADERS, [p.row() for p in prefill]),
        "### Beside the paper",
        markdown_table(["point", "ours (eq. 5)", "closed form (6)", "paper"], beside),
        "### One 24 GB/s link: OPT-13B / Llama-2-13B, TPOT 100 ms, sequence 64 (section 5.5)",
        markdown_table(["batch", "max interval (memory)", "min interval (SLO, own link)",
                        "copy ms/step at max interval", "coordinator", "host GiB",
                        "link GB/s"], links),
        _why(decode, prefill, acc)])


def _why(decode: list[SweepPoint], prefill: list[SweepPoint],
         acc: dict[str, float]) -> str:
    misses = sum(p.closed_form_latency_s > p.slo_s for p in decode + prefill)
    decode_ratio = acc["qwen_decode_transfer_over_compute"]
    prefill_ratio = acc["qwen_prefill_transfer_over_compute"]
    return f"""### Why they differ

- T_c is a roofline here, measured there. The sharpest check is fig. 2b: T_T/T_c of
  Qwen2-beta-7B at batch 4, sequence 256 is {decode_ratio:.1f} in decode here against the
  paper's measured 13.8 (prefill {prefill_ratio:.1f} against 3.5). The roofline's decode
  layer (weights read at 80% of 600 GB/s) is faster than vLLM's kernels on an A10, so fewer
  resident layers' compute hides one copy and the decode interval comes out larger
  ({acc["decode_interval_d0.5"]:.0f} at delta 0.5; the paper's is 8). Prefill is
  compute-bound, its ratio near the paper's, and its interval
  ({acc["prefill_interval_d0.5"]:.0f}; the paper's is 3) follows. Measured per-layer times
  (`LayerCosts.on_link` takes a table) would close the gap; the paper itself warns
  (observation 2) that peak-based estimates mislead.
- Equation (3) charges each interval the copy time its i - 1 resident layers do not hide; the
  paper's closed form (6) budgets all copies against the whole slowed step, as if the copy
  stream never waited for an interval to start, and floors L / L_off. It misses the SLO it
  was given at {misses} of the {len(decode) + len(prefill)} points above (column "(6)
  latency/SLO" > 1), and answers 1 (DeepSpeed) for loose prefill SLOs.
- The paper states SLOs relative to the step without offloading ("SLO quotient"), as here;
  its latencies also hold vLLM's scheduling and sampling, which the step model leaves out.
- Section 5.5 reports both 13B models under 100 ms TPOT sharing one 24 GB/s link, each with
  more weight than fits 24 GiB. Here the memory left after embeddings and KV (95% of 24 GiB)
  forces each to an interval the SLO cannot take even on its own link: the copies alone
  (column "copy ms/step") exceed 100 ms, whatever the overlap, so the coordinator refuses
  (the paper would pass the request up). The paper's point needs more of the weights
  resident (less KV or memory reserve than assumed here) or a faster link.
"""


def _body(cfg: SelectNExpConfig, text: str, acceptance: dict[str, float]) -> str:
    command = "python -m fineslab.sim selectn" + (" --quick" if cfg.quick else "")
    return "\n".join([
        "# Select-N: the offloading interval and host memory per SLO", "",
        f"Reproduce: `{command}` (no simulation: the cost model of `scheduler/selectn.py` on "
        "the roofline of the paper's A10; the module docstring of "
        "`fineslab/sim/experiments/selectn.py` states the model, machine and points).", "",
        "```json", str(acceptance), "```", "", text, ""])

"""Fidelity check: one workload measured live with the load generator and simulated with a
stored profile of the same stack; TTFT, TPOT, e2e and throughput side by side, with the
relative error.

Live side: the full stack by default, the one-model fleet of `fineslab.profile.one_model`
(`python -m fineslab.launch`: one runtime with the plugin in a CPU `kv_pool: arena` of
32,768 KV tokens, chunked prefill of `profile.chunk_tokens`, radix cache off, the router with
the FCFS batch policy in front), the workload sent to the router, the fleet stopped afterwards;
or `--url` of any OpenAI-compatible endpoint serving the profiled model.
Simulated side: the same requests on one replica (FCFS, the profile's step latencies, the real
slab table sized to the same 32,768-token pool). The default profile is
`profiles/llama-tiny--bf16--cpu-http.json`, measured through that same fleet by `python -m
fineslab.profile measure --via http` (so HTTP, router, tokenizer and engine overheads are in
its times). `--calibrate` also re-measures the live endpoint just before the workload
(`calibrate.py`) and simulates with that profile too. The workload is Poisson at a low rate
with ShareGPT lengths clipped to what a CPU serves in seconds (prompts <= 128, outputs <= 16).

    error = |simulated - live| / live

The live side runs the workload `repeats` times (3; 1 with --quick) on the same endpoint; its
figure for each metric is the median of the runs, reported with its min and max
(`<metric>_live_min` / `_live_max`), and an error above 0.25 is explained in the report against
that spread: how far the live runs strayed from each other, and whether the simulated value lies
within them.

Report keys: `<metric>_stored_profile` (live, sim, error) always; the target is
`ttft_p50_error_stored_profile < 0.25`. The unsuffixed keys (`ttft_p50_error`, ...) are the
last profile simulated: the calibrated one with `--calibrate`, else the stored one again.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fineslab.scheduler.placement import GpuSpec
from fineslab.scheduler.profile_schema import ModelProfile, load_profile, save_profile

from fineslab.loadgen.client import ClientConfig
from fineslab.loadgen.metrics import Summary
from fineslab.loadgen.run import BenchConfig, run_benchmark
from fineslab.sim.config import SimConfig, SystemSpec
from fineslab.sim.experiments.calibrate import calibrate, load_average
from fineslab.sim.experiments.report import markdown_table, write_report
from fineslab.sim.simulator import FleetModel, simulate
from fineslab.workload import ModelLoad, Request, WorkloadSpec, build_workload

logger = logging.getLogger(__name__)

SGLANG_FCFS = SystemSpec("sglang", "mme", "fcfs", "shared")
#: The relative error above which the report explains a metric against the live spread.
ERROR_TARGET = 0.25
KV_POOL_TOKENS = 32768
DEFAULT_PROFILE = Path("profiles/llama-tiny--bf16--cpu-http.json")
STORED, CALIBRATED = "stored profile", "calibrated profile"


@dataclass(frozen=True)
class FidelityConfig:
    out_dir: Path
    profile_path: Path
    sharegpt: Path
    model_cache: Path
    url: str | None = None
    served_model: str | None = None
    rate_per_s: float = 0.25
    duration_s: float = 120.0
    max_prompt_tokens: int = 128
    max_output_tokens: int = 16
    ttft_slo_s: float = 5.0
    seed: int = 0
    #: Also measure the endpoint's step latencies just before the run (see `calibrate`).
    calibrate: bool = False
    #: Live runs of the workload (module doc).
    repeats: int = 3


def fidelity_requests(cfg: FidelityConfig, model: str) -> list[Request]:
    spec = WorkloadSpec((ModelLoad(model, cfg.rate_per_s),), cfg.duration_s, cfg.sharegpt,
                        max_prompt_tokens=cfg.max_prompt_tokens,
                        max_output_tokens=cfg.max_output_tokens, seed=cfg.seed)
    return build_workload(spec)


@contextlib.contextmanager
def live_endpoint(cfg: FidelityConfig, profile: ModelProfile,
                  ) -> Iterator[tuple[str, str, Path | None]]:
    """(base URL, model field, tokenizer) of `cfg.url`, or of a one-model fleet started here."""
    if cfg.url is not None:
        yield cfg.url, cfg.served_model or profile.model, None
        return
    # Imported here: the simulator-only experiments need neither a model nor a launcher.
    from fineslab.models.generate import ensure_model
    from fineslab.profile.measure import MeasureConfig
    from fineslab.profile.measure_http import fleet_spec
    from fineslab.profile.one_model import serve_one_model

    model_dir = ensure_model(profile.model, cfg.model_cache)
    measure = MeasureConfig(profile.model, cfg.model_cache, cfg.out_dir,
                            chunk_tokens=profile.chunk_tokens, max_total_tokens=KV_POOL_TOKENS)
    with serve_one_model(fleet_spec(measure, model_dir)) as url:
        yield url, profile.model, model_dir


@dataclass(frozen=True)
class LiveRun:
    summaries: tuple[Summary, ...]  # one per repeat
    calibrated: ModelProfile | None
    load_average: tuple[float, float]  # before the first run and after the last


def measure_live(cfg: FidelityConfig, profile: ModelProfile,
                 requests: list[Request]) -> LiveRun:
    """Optionally calibrate, then run the workload with the load generator."""
    model = requests[0].model
    with live_endpoint(cfg, profile) as (url, served, tokenizer):
        bench = BenchConfig(ClientConfig(url), slo_s={model: cfg.ttft_slo_s},
                            served_names={model: served}, tokenizer=tokenizer,
                            progress=False, seed=cfg.seed)
        calibrated = calibrate(profile, bench, model) if cfg.calibrate else None
        before = load_average()
        summaries = []
        for run in range(cfg.repeats):
            summaries.append(run_benchmark(bench, requests).summary())
            logger.info("fidelity: live run %d of %d: TTFT p50 %s s", run + 1, cfg.repeats,
                        summaries[-1].ttft_s.p50)
        return LiveRun(tuple(summaries), calibrated, (before, load_average()))


def simulate_same(cfg: FidelityConfig, profile: ModelProfile, requests: list[Request],
                  config: SimConfig) -> Summary:
    non_kv_bytes = profile.weights_bytes + int(profile.activation_bytes(1))
    memory_bytes = non_kv_bytes + KV_POOL_TOKENS * profile.kv_token_bytes * 2
    model = FleetModel(requests[0].model, profile, cfg.rate_per_s, cfg.ttft_slo_s)
    gpus = [GpuSpec(0, memory_bytes, profile.device)]
    return simulate([model], gpus, SGLANG_FCFS, requests, cfg.duration_s, config).summary()


def run_fidelity(cfg: FidelityConfig, config: SimConfig) -> tuple[dict[str, float], str]:
    profile = load_profile(cfg.profile_path)
    requests = fidelity_requests(cfg, profile.model)
    logger.info("fidelity: %d requests over %.0f s", len(requests), cfg.duration_s)
    live = measure_live(cfg, profile, requests)
    sims = {STORED: simulate_same(cfg, profile, requests, config)}
    if live.calibrated is not None:
        save_profile(live.calibrated, cfg.out_dir / "calibrated")
        sims[CALIBRATED] = simulate_same(cfg, live.calibrated, requests, config)
    tables, acceptance = [], {}
    for label, sim in sims.items():
        rows, numbers = _compare(live.summaries, sim)
        tables.append(f"Simulated with the {label}:\n\n"
                      + markdown_table(["metric", "live (median)", "live min-max", "simulated",
                                        "relative error"], rows)
                      + _explained(numbers, len(live.summaries), live.load_average))
        if label == STORED:
            acceptance.update({f"{k}_stored_profile": v for k, v in numbers.items()})
        acceptance.update(numbers)  # unsuffixed: the last profile simulated
    acceptance["calibrated"] = float(live.calibrated is not None)
    acceptance["live_runs"] = float(len(live.summaries))
    acceptance["num_completed_live"] = float(min(s.num_completed for s in live.summaries))
    acceptance["load_average_before"], acceptance["load_average_after"] = live.load_average
    text = "\n\n".join(tables)
    write_report(cfg.out_dir, "fidelity", _body(cfg, profile, len(requests), live, text))
    return acceptance, text


METRICS = ("ttft_p50", "ttft_p95", "tpot_p50", "e2e_p50", "output_tok_s")


def _metrics(summary: Summary) -> dict[str, float | None]:
    return {"ttft_p50": summary.ttft_s.p50, "ttft_p95": summary.ttft_s.p95,
            "tpot_p50": summary.tpot_s.p50, "e2e_p50": summary.e2e_s.p50,
            "output_tok_s": summary.output_tokens_per_s}


def _compare(live: Sequence[Summary], sim: Summary
             ) -> tuple[list[list[object]], dict[str, float]]:
    """Per metric: the live runs' median, min and max, the simulated value and the error of the
    simulated value against the live median."""
    runs = [_metrics(summary) for summary in live]
    rows: list[list[object]] = []
    numbers: dict[str, float] = {}
    for name, model in _metrics(sim).items():
        values = [v for run in runs if (v := run[name]) is not None]
        have = statistics.median(values) if values else None
        error = abs(model - have) / have if have and model is not None else float("nan")
        low, high = (min(values), max(values)) if values else (None, None)
        rows.append([name, _r(have), f"{_r(low)}-{_r(high)}", _r(model), _r(error)])
        numbers[f"{name}_live"], numbers[f"{name}_sim"] = _r(have), _r(model)
        numbers[f"{name}_live_min"], numbers[f"{name}_live_max"] = _r(low), _r(high)
        numbers[f"{name}_error"] = _r(error)
    return rows, numbers


def _explained(numbers: dict[str, float], runs: int, load: tuple[float, float]) -> str:
    """For each metric whose error is above ERROR_TARGET: the live runs' own spread, and whether
    the simulated value lies within it ("" when none is)."""
    lines = []
    for name in METRICS:
        error, have = numbers[f"{name}_error"], numbers[f"{name}_live"]
        if not error > ERROR_TARGET:  # NaN: not compared
            continue
        low, high = numbers[f"{name}_live_min"], numbers[f"{name}_live_max"]
        model = numbers[f"{name}_sim"]
        where = ("within the live runs' own range: the live side's spread alone explains it"
                 if low <= model <= high else
                 "outside the live runs' range: beyond the live side's spread, the rest is the "
                 "model's (notes below)")
        lines.append(f"- `{name}`: error {error:.2f}. Over {runs} live run(s) it ranged "
                     f"{low:g}-{high:g} ({(high - low) / have:.0%} of their median; load "
                     f"average {load[0]:.1f} before, {load[1]:.1f} after); the simulated "
                     f"{model:g} is {where}.")
    return (f"\n\nErrors above {ERROR_TARGET:g}, against the live side's spread:\n\n"
            + "\n".join(lines)) if lines else ""


def _r(value: float | None) -> float:
    return round(value, 4) if value is not None else float("nan")


def _body(cfg: FidelityConfig, profile: ModelProfile, num_requests: int, live: LiveRun,
          table: str) -> str:
    target = cfg.url or ("the full stack started for the run (`python -m fineslab.launch`: "
                         "one runtime with the plugin in a CPU arena, the router in front)")
    measured = profile.provenance.get("measured_via", "in-process (`fineslab.profile measure`)")
    when = profile.provenance.get("created", "?")
    load = profile.provenance.get("load_average", "not recorded")
    return "\n".join([
        "# Fidelity: simulator versus a live server", "",
        "Reproduce: `python -m fineslab.sim fidelity` (add `--calibrate` to re-measure the "
        "endpoint before the run; `--url URL --profile PATH` for another endpoint).", "",
        f"Live: {target}; model {profile.model}. Profile `{cfg.profile_path}` ({profile.source}, "
        f"chunk {profile.chunk_tokens} tokens), measured {when} via {measured}; load average "
        f"then: {load}. Workload: {num_requests} requests, Poisson {cfg.rate_per_s:g} req/s "
        f"for {cfg.duration_s:g} s, ShareGPT lengths clipped to {cfg.max_prompt_tokens} prompt "
        f"/ {cfg.max_output_tokens} output tokens, seed {cfg.seed}. Simulated: one replica, "
        f"FCFS, the profile's step latencies, interference off (one model). Load average of "
        f"the machine (2 cores, shared) before and after the live run: "
        f"{live.load_average[0]:.1f} / {live.load_average[1]:.1f}.", "",
        "Target: `ttft_p50_error_stored_profile` < 0.25 (the stored profile, no calibration in "
        "the run).", "", table, "", FIDELITY_NOTES, ""])


FIDELITY_NOTES = """Where the error comes from: the simulator charges a prefill step
`prefill_s(tokens)` and a decode step `decode.step_s(batch, context)` read off the profile, and
nothing else: no HTTP, router, tokenizer or detokenizer. The default stored profile,
`profiles/llama-tiny--bf16--cpu-http.json`, is measured through the same stack as the live run
(`python -m fineslab.profile measure --via http`: the launcher, the plugin in a CPU arena, the
router), so those costs are inside its times. The in-process profile
(`profiles/llama-tiny--bf16--cpu.json`, `fineslab.profile measure`) leaves them out, and at
these tiny sizes (a 16-token prefill takes about 7 ms in-process) its TTFT came out low by more
than half (errors 0.57-0.69 against a plain SGLang server, 2026-11-22 and 23). What remains:
the probes are lone requests at four prompt lengths, interpolated linearly; the decode table is
measured at short contexts and the same for every context; and every number depends on the
machine's load. On a 2-core machine shared with other jobs the stack's processes (launcher,
router, HTTP/tokenizer, scheduler, detokenizer) compete with those jobs, so a run under another
load than the profile's (its provenance records it, quoted above) is slower or faster than the
profile says, and the error grows with the difference (0.60 at a load average of 14 on
2026-11-22, even with a profile measured minutes before). `--calibrate` re-runs the same probes
on the live endpoint just before the workload and simulates with that profile too: it removes
the difference in time, not the rest. The load averages of this run are stated above."""

"""Where Algorithm 2 decides, live: SGLang's default vs the router's gate vs the engine policy.

    python -m fineslab.bench.engine_policy [--json] [--quick] [--seed N] [--load X]
                                           [--modes sglang,router,engine,engine-static]
                                           [--repeats N]

One model (`m`, llama-small; --quick: llama-tiny) is launched once per mode on this machine,
all fleets up at once, and the same requests (Poisson arrivals, ShareGPT prompt lengths divided
by `LENGTH_SCALE`, outputs of at most 8 tokens so that prefill is most of the work, streamed,
`fineslab.bench.serve`'s client) are sent to each fleet's router:

    sglang   batch_policy fcfs: the router passes requests up to the runtime's slots and drops
             none; SGLang's own scheduler forms every batch (its default)
    router   batch_policy adaptive-early-shed at the router (the default gate); SGLang forms
             the batches of what the gate let through
    engine   the same gate, and `local_scheduler: engine`: inside the runtime the same policy,
             with the router's deadlines, picks SGLang's prefill batches (EDF, TTFT admission
             behind the prefill under way, drop); its predictor is refreshed from the prefill
             steps the runtime times (`engine_refresh: true`, the default)
    engine-static  the same with `engine_refresh: false`: the profile decides as measured

The requests are sent in `--repeats` rounds (3; 1 with --quick), each round to every mode in
turn, the first mode rotating from round to round, so a slow moment of the machine lands on each
mode alike. Before the rounds, on the first fleet: a profile is measured over HTTP
(`fineslab.sim.experiments.calibrate`), and the router and engine fleets run with it, so their
predictor is this machine's now. Every fleet is then warmed up by a burst of 3 x max_running
requests of the workload's lengths, all at once; on the first fleet (SGLang's batching, which
drops nothing) that burst measures the saturation throughput (completed / seconds,
`saturation_per_s`), and arrivals are offered at `load` x it (load 1.25: a quarter more than
the server completes).

Figures (last line, with --json): per mode `attainment` (requests whose first token came within
the SLO / all requests), `goodput_per_s` (such requests a second) and TTFT p50/p99 of completed
requests, each the median of the rounds with its spread (`<figure>_spread`: median, min, max,
n); `requests`, `completed`, `dropped` (answered 429/503), `failed` (anything else) and for the
engine fleets `engine_drops` (the runtime's drops, from the router's metrics), summed over the
rounds; `rounds`, each round's own figures with the load averages before and after it (the
machine is shared, and a round run while another job loads it is slower for that reason alone).
Top level: `attainment_<mode>` for each mode run, `engine_over_router` and `engine_over_sglang`
(the median of the rounds' attainment ratios, with their spread, when those modes ran), the
offered `rate_per_s` and the order the runs went in.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from fineslab.bench.chaos_fleet import ChaosFleet
from fineslab.bench.repeats import interleave, merge_rounds, spread
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.plan import model_dir_of
from fineslab.fleet.profiles import find_profile
from fineslab.loadgen.client import ClientConfig
from fineslab.loadgen.run import BenchConfig, BenchResult, run_benchmark
from fineslab.scheduler.profile_schema import save_profile
from fineslab.sim.experiments.calibrate import calibrate, load_average
from fineslab.tables import add_json_flag, emit, repeats_arg
from fineslab.workload import ModelLoad, Request, WorkloadSpec, build_workload
from fineslab.workload.traces import SHAREGPT_STATS

logger = logging.getLogger(__name__)

MODEL = "m"
MODES = ("sglang", "router", "engine", "engine-static")
#: Fleet ids (names of /dev/shm files) by mode.
FLEET_IDS = {"sglang": "ebsgl", "router": "ebrou", "engine": "ebeng", "engine-static": "ebsta"}
REPO = Path(__file__).resolve().parents[2]
LENGTH_SCALE = 8


@dataclass(frozen=True)
class EngineBenchConfig:
    preset: str = "llama-small"
    ttft_slo_s: float = 2.0
    duration_s: float = 40.0
    load: float = 1.25
    max_prompt_tokens: int = 512
    max_output_tokens: int = 8
    max_running: int = 16
    seed: int = 0
    modes: tuple[str, ...] = MODES
    #: interleaved rounds of the requests on every mode's fleet
    repeats: int = 3


QUICK = EngineBenchConfig(preset="llama-tiny", ttft_slo_s=1.0, duration_s=12.0, repeats=1)


def fleet_config(cfg: EngineBenchConfig, mode: str, fleet_id: str,
                 profile: Path | None) -> dict[str, Any]:
    model: dict[str, Any] = {"name": MODEL, "preset": cfg.preset, "precision": "bf16",
                             "kv_dtype": "bf16", "ttft_slo_s": cfg.ttft_slo_s,
                             "request_rate_per_s": 1.0, "replicas": 1}
    if profile is not None:
        model["profile"] = str(profile)
    return {"fleet_id": fleet_id, "kv_pool": "arena", "placement": "mme",
            "batch_policy": "fcfs" if mode == "sglang" else "adaptive-early-shed",
            "local_scheduler": "engine" if mode.startswith("engine") else "router",
            "engine_refresh": mode != "engine-static",
            "devices": [{"name": "cpu", "kind": "cpu", "memory_gib": 8, "kv_arena_mib": 128}],
            "router": {"host": "127.0.0.1", "max_running_requests": cfg.max_running},
            "models": [model]}


def workload(cfg: EngineBenchConfig, rate_per_s: float) -> list[Request]:
    spec = WorkloadSpec((ModelLoad(MODEL, rate_per_s),), cfg.duration_s, SHAREGPT_STATS,
                        max_prompt_tokens=cfg.max_prompt_tokens * LENGTH_SCALE,
                        max_output_tokens=cfg.max_output_tokens, seed=cfg.seed)
    return [replace(r, prompt_tokens=max(8, r.prompt_tokens // LENGTH_SCALE),
                    output_tokens=max(1, r.output_tokens))
            for r in build_workload(spec)]


def _bench(base_url: str, cfg: EngineBenchConfig, progress: bool) -> BenchConfig:
    return BenchConfig(ClientConfig(base_url), slo_s={MODEL: cfg.ttft_slo_s},
                       progress=progress, seed=cfg.seed)


def engine_drops(base_url: str) -> int:
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return -1
    found = re.search(r'fineslab_requests_dropped_total\{[^}]*outcome="engine"[^}]*\} ([0-9.e+]+)',
                      text)
    return int(float(found.group(1))) if found else 0


def _mode_figures(result: BenchResult, slo_s: float) -> dict[str, Any]:
    summary, outcomes = result.summary(), result.outcomes
    met = sum(1 for o in outcomes if o.met_slo)
    dropped = sum(1 for o in outcomes if (o.dropped or "").startswith(("HTTP 429", "HTTP 503")))

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {"requests": summary.num_requests, "completed": summary.num_completed,
            "dropped": dropped, "failed": summary.num_requests - summary.num_completed - dropped,
            "attainment": round(summary.slo_attainment or 0.0, 4),
            "goodput_per_s": round(met / result.wall_s, 3) if result.wall_s > 0 else 0.0,
            "ttft_p50_s": seconds(summary.ttft_s.p50), "ttft_p99_s": seconds(summary.ttft_s.p99),
            "slo_s": slo_s}


def _launch(cfg: EngineBenchConfig, mode: str, folder: Path, profile: Path | None,
            ) -> ChaosFleet:
    return ChaosFleet.launch(fleet_config(cfg, mode, f"{FLEET_IDS[mode]}{cfg.seed}", profile),
                             folder, mode)


def _one_run(fleet: ChaosFleet, cfg: EngineBenchConfig, requests: list[Request],
             progress: bool) -> dict[str, Any]:
    """The workload once on `fleet`: its figures (`_mode_figures`) and the machine's load."""
    load_before, drops_before = load_average(), engine_drops(fleet.base_url)
    result = run_benchmark(_bench(fleet.base_url, cfg, progress), requests)
    figures = _mode_figures(result, cfg.ttft_slo_s)
    figures.update(engine_drops=engine_drops(fleet.base_url) - drops_before,
                   load_before=load_before, load_after=load_average(),
                   wall_s=round(result.wall_s, 1))
    return figures


#: Per-mode figures summed over the rounds (the rest are medians, the timed ones with spread).
SUMMED = ("requests", "completed", "dropped", "failed", "engine_drops")
SPREAD = ("attainment", "goodput_per_s", "ttft_p50_s", "ttft_p99_s")


def summarize_mode(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one entry: counts summed, figures the median of the rounds, the
    timed ones with their spread, and every round's own figures under `rounds`."""
    return {"slo_s": rounds[0]["slo_s"],
            **merge_rounds(rounds, SUMMED + SPREAD, summed=SUMMED, with_spread=SPREAD),
            "rounds": rounds}


def run(cfg: EngineBenchConfig, progress: bool = False) -> dict[str, Any]:
    """Every mode's fleet up at once (the first, SGLang's batching, calibrates the profile the
    others run with and measures the saturation throughput), then `repeats` interleaved rounds
    of the same requests on each."""
    folder = Path(tempfile.mkdtemp(prefix="fineslab-enginebench-"))
    fleets: dict[str, ChaosFleet] = {}
    order: list[str] = []
    try:
        first = cfg.modes[0]
        fleets[first] = _launch(cfg, first, folder, None)
        bench = _bench(fleets[first].base_url, cfg, progress)
        profile_path = _calibrate(cfg, bench, folder)
        # The warm-up burst (the first requests of a fresh CPU server are several times
        # slower) measures the saturation throughput on the first fleet, which drops nothing.
        saturation = saturation_rate(cfg, bench)
        rate_per_s = cfg.load * saturation
        requests = workload(cfg, rate_per_s)
        logger.info("offered %.2f requests/s (%d requests)", rate_per_s, len(requests))
        for mode in cfg.modes[1:]:
            fleets[mode] = _launch(cfg, mode, folder, profile_path)
            saturation_rate(cfg, _bench(fleets[mode].base_url, cfg, False))
        # Other jobs change the machine's speed over minutes: the rounds rotate which mode goes
        # first, and odd seeds take the modes in the reverse order.
        modes = cfg.modes if cfg.seed % 2 == 0 else (first, *reversed(cfg.modes[1:]))

        def side(mode: str) -> Callable[[int], dict[str, Any]]:
            def one(round_: int) -> dict[str, Any]:
                order.append(mode)
                figures = _one_run(fleets[mode], cfg, requests, progress)
                logger.info("%s round %d: %s", mode, round_, figures)
                return figures
            return one

        rounds = interleave({mode: side(mode) for mode in modes}, cfg.repeats)
    finally:
        for fleet in fleets.values():
            fleet.interrupt()
            fleet.cleanup()
        shutil.rmtree(folder, ignore_errors=True)
    results = {mode: summarize_mode(rounds[mode]) for mode in cfg.modes}
    att = {mode: results[mode]["attainment"] for mode in cfg.modes}
    ratios: dict[str, Any] = {}
    for base in ("router", "sglang"):
        if "engine" in rounds and base in rounds:
            by_round = [e["attainment"] / b["attainment"]
                        for e, b in zip(rounds["engine"], rounds[base], strict=True)
                        if b["attainment"]]
            ratios[f"engine_over_{base}"] = round(statistics.median(by_round), 3) \
                if by_round else None
            if by_round:
                ratios[f"engine_over_{base}_spread"] = spread(by_round, 3)
    return {"config": cfg.__dict__, "order": order, "rate_per_s": round(rate_per_s, 3),
            "saturation_per_s": round(saturation, 3),
            "mean_prompt_tokens": round(statistics.fmean(r.prompt_tokens for r in requests), 1),
            "modes": results, **{f"attainment_{m}": a for m, a in att.items()}, **ratios,
            "load_average": load_average()}


def _calibrate(cfg: EngineBenchConfig, bench: BenchConfig, folder: Path) -> Path:
    """A profile measured on the fleet now."""
    config = fleet_from_dict(fleet_config(cfg, "sglang", "x", None), "bench")
    model = config.models[0]
    base = find_profile(model, "cpu", [REPO / "profiles"], model_dir_of(model))
    measured = calibrate(base, replace(bench, progress=False), MODEL)
    return save_profile(measured, folder / "profiles")


def saturation_rate(cfg: EngineBenchConfig, bench: BenchConfig) -> float:
    """Requests/s the fleet completes when it always has work: a burst of 3 x max_running
    requests of the workload's lengths (not the workload's own), all sent at once."""
    sample = workload(replace(cfg, seed=cfg.seed + 1000), 10.0)[: 3 * cfg.max_running]
    burst = [replace(r, request_id=f"saturate-{i}", arrival_s=0.0) for i, r in enumerate(sample)]
    result = run_benchmark(replace(bench, progress=False), burst)
    done = sum(1 for o in result.outcomes if o.completed)
    logger.info("saturation: %d of %d requests in %.1f s", done, len(burst), result.wall_s)
    return done / result.wall_s


def _modes(text: str) -> tuple[str, ...]:
    """The modes asked for, "sglang" first: its fleet, which drops nothing, calibrates the
    profile and measures the saturation rate for all."""
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sglang" not in modes:
        raise argparse.ArgumentTypeError(f"modes are sglang and any of {', '.join(MODES[1:])}; "
                                         f"got {text!r}")
    return ("sglang", *(m for m in modes if m != "sglang"))




def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.engine_policy",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 12 s of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=float, default=None,
                        help="offered load, x the measured saturation throughput (default 1.25)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    parser.add_argument("--modes", type=_modes, default=MODES,
                        help=f"comma-separated, sglang among them (default {','.join(MODES)})")
    parser.add_argument("--repeats", type=repeats_arg, default=None,
                        help="interleaved rounds of the requests on every mode (default 3; "
                             "--quick: 1)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    cfg = replace(QUICK if args.quick else EngineBenchConfig(), seed=args.seed,
                  modes=args.modes)
    if args.load is not None:
        cfg = replace(cfg, load=args.load)
    if args.duration is not None:
        cfg = replace(cfg, duration_s=args.duration)
    if args.repeats is not None:
        cfg = replace(cfg, repeats=args.repeats)
    out = run(cfg, progress=not args.json)
    rows = [[mode, f["requests"], f["completed"], f["dropped"], f["failed"], f["attainment"],
             f["goodput_per_s"], f["ttft_p50_s"], f["ttft_p99_s"], f["engine_drops"]]
            for mode, f in out["modes"].items()]
    emit(f"engine policy: {out['rate_per_s']} requests/s offered, SLO {cfg.ttft_slo_s} s",
         ["mode", "requests", "completed", "dropped", "failed", "attainment", "goodput/s",
          "TTFT p50", "TTFT p99", "engine drops"], rows, out, args.json)
    return 0 if all(f["failed"] == 0 for f in out["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

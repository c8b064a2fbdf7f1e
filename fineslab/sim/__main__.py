"""CLI: `python -m fineslab.sim {fig10,fig11,fig12,fig13,capacity,capacity-parts,elastic,fidelity,
oneiros,selectn,swiftcache} [--quick] [--json]`.

Each experiment writes `<out>/<name>.md` and PNG plots (default out: results/<name>/), prints
a table, and with --json prints its acceptance numbers as the last line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from fineslab.sim.config import SimConfig
from fineslab.sim.experiments.common import Traces
from fineslab.tables import add_json_flag, emit, repeats_arg
from fineslab.workload import AZURE_CONV, SHAREGPT_STATS

logger = logging.getLogger(__name__)


def _common(args: argparse.Namespace, name: str) -> tuple[Path, Traces, SimConfig]:
    out = Path(args.out or f"results/{name}")
    config = SimConfig(interference_per_neighbor=args.interference)
    return out, Traces(Path(args.sharegpt), Path(args.azure)), config


def _finish(args: argparse.Namespace, title: str, text: str,
            acceptance: dict[str, float]) -> int:
    print(text)
    rows = [[k, v] for k, v in sorted(acceptance.items())]
    emit(title, ["metric", "value"], rows, acceptance, args.json)
    return 0


def _fig10(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.fig10 import Fig10Config, run_fig10

    out, traces, config = _common(args, "fig10")
    cfg = Fig10Config(out, traces, quick=args.quick,
                      duration_s=args.duration or (60.0 if args.quick else 120.0),
                      seed=args.seed)
    acceptance, text = run_fig10(cfg, config)
    return _finish(args, "fig10 acceptance (Poisson, rate scale 8, SLO scale 20)", text,
                   acceptance)


def _fig11(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.fig11 import Fig11Config, run_fig11

    out, traces, config = _common(args, "fig11")
    cfg = Fig11Config(out, traces, quick=args.quick,
                      duration_s=args.duration or (60.0 if args.quick else 120.0),
                      seed=args.seed)
    acceptance, text = run_fig11(cfg, config)
    return _finish(args, "fig11: SLO attainment by fleet size (Poisson)", text, acceptance)


def _ablation(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.ablations import AblationConfig, run_fig12, run_fig13

    out, traces, config = _common(args, args.command)
    cfg = AblationConfig(out, traces, quick=args.quick,
                         duration_s=args.duration or (60.0 if args.quick else 120.0),
                         seed=args.seed)
    run = run_fig12 if args.command == "fig12" else run_fig13
    acceptance, text = run(cfg, config)
    return _finish(args, f"{args.command} results", text, acceptance)


def _capacity(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.capacity import CapacityConfig, run_capacity

    out, traces, config = _common(args, "capacity")
    cfg = CapacityConfig(out, traces, quick=args.quick,
                         duration_s=args.duration or (60.0 if args.quick else 120.0),
                         seeds=(args.seed,) if args.quick else (args.seed, args.seed + 1),
                         tolerance=0.25 if args.quick else 0.125)
    acceptance, text = run_capacity(cfg, config)
    return _finish(args, "capacity: largest rate scale at 99% SLO attainment (Poisson, SLO "
                   "scale 5) and GPUs for 99%", text, acceptance)


def _capacity_parts(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.capacity_parts import default_config, run_parts

    out, traces, config = _common(args, "capacity-parts")
    cfg = default_config(out, traces, args.quick, args.seed, args.duration)
    acceptance, text = run_parts(cfg, config)
    return _finish(args, "capacity by part (Poisson) and under KV memory pressure (SLO 5)",
                   text, acceptance)


def _fidelity(args: argparse.Namespace) -> int:
    from fineslab.env import FineslabEnv
    from fineslab.profile.one_model import exit_on_sigterm
    from fineslab.sim.experiments.fidelity import DEFAULT_PROFILE, FidelityConfig, run_fidelity

    exit_on_sigterm()  # a `timeout` stops the fleet through the `finally` blocks

    out, traces, config = _common(args, "fidelity")
    cfg = FidelityConfig(out, Path(args.profile or DEFAULT_PROFILE), traces.sharegpt,
                         Path(FineslabEnv.from_environ().model_cache_dir), url=args.url,
                         served_model=args.served_model,
                         duration_s=args.duration or (40.0 if args.quick else 120.0),
                         seed=args.seed, calibrate=args.calibrate,
                         repeats=args.repeats or (1 if args.quick else 3))
    acceptance, text = run_fidelity(cfg, replace(config, interference_per_neighbor=0.0))
    return _finish(args, "fidelity: live versus simulated", text, acceptance)


def _elastic(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.elastic import ElasticExpConfig, run_elastic

    out, traces, config = _common(args, "elastic")
    cfg = ElasticExpConfig(out, traces, quick=args.quick,
                           duration_s=args.duration or (90.0 if args.quick else 300.0),
                           seeds=(args.seed,) if args.quick else (args.seed, args.seed + 1),
                           num_models=8 if args.quick else 24,
                           max_gpus=3 if args.quick else 6, rate_per_s=args.rate)
    acceptance, text = run_elastic(cfg, config)
    return _finish(args, "elastic: GPUs for 99% SLO attainment", text, acceptance)


def _oneiros(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.oneiros import OneirosExpConfig, run_oneiros

    out, traces, config = _common(args, "oneiros")
    cfg = OneirosExpConfig(out, traces, quick=args.quick,
                           duration_s=args.duration or (60.0 if args.quick else 120.0),
                           seeds=(args.seed, args.seed + 1))
    acceptance, text = run_oneiros(cfg, config)
    return _finish(args, "oneiros: P99 TTFT/TBT, lending vs none (temporal sharing)", text,
                   acceptance)


def _selectn(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.selectn import SelectNExpConfig, run_selectn

    cfg = SelectNExpConfig(Path(args.out or "results/selectn"), quick=args.quick)
    acceptance, text = run_selectn(cfg)
    return _finish(args, "selectn: offloading interval and host memory per SLO", text,
                   acceptance)


def _swiftcache(args: argparse.Namespace) -> int:
    from fineslab.sim.experiments.swiftcache import SwiftCacheExpConfig, run_swiftcache

    out, traces, _ = _common(args, "swiftcache")
    cfg = SwiftCacheExpConfig(out, traces, quick=args.quick,
                              duration_s=args.duration or (300.0 if args.quick else 600.0),
                              seeds=(args.seed, args.seed + 1))
    acceptance, text = run_swiftcache(cfg)
    return _finish(args, "swiftcache: master P99 TTFT, prefix KV recomputed / on host / lent",
                   text, acceptance)


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "fig10": ("end-to-end SLO attainment and tokens/s on 4 H100s", _fig10),
    "fig11": ("SLO attainment from 8 to 16 GPUs", _fig11),
    "fig12": ("placer ablation: MME versus KVPR, static KV, FCFS", _ablation),
    "fig13": ("local scheduler ablation: one model, static KV", _ablation),
    "capacity": ("largest rate scale at 99% SLO attainment, and GPUs for 99%", _capacity),
    "capacity-parts": ("capacity of fineslab's parts one at a time, and under memory "
                       "pressure", _capacity_parts),
    "elastic": ("more models than fit: sleep/wake, fineslab vs Prism* vs no sleep", _elastic),
    "fidelity": ("live server versus simulator on one workload", _fidelity),
    "oneiros": ("Oneiros layer lending under temporal sharing, C1/C2 on one GPU", _oneiros),
    "selectn": ("Select-N: offloading interval and host memory per SLO", _selectn),
    "swiftcache": ("SwiftCache: a master's prefix KV lent to co-located workers", _swiftcache),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, func) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text.replace("%", "%%"))  # argparse %-formats it
        cmd.add_argument("--quick", action="store_true", help="the acceptance points only")
        cmd.add_argument("--out", default=None, help=f"report folder (results/{name}/)")
        cmd.add_argument("--seed", type=int, default=0)
        cmd.add_argument("--duration", type=float, default=None,
                         help="seconds of arrivals per point")
        cmd.add_argument("--sharegpt", default=str(SHAREGPT_STATS),
                         help="ShareGPT length stats CSV")
        cmd.add_argument("--azure", default=str(AZURE_CONV), help="Azure-format trace CSV")
        cmd.add_argument("--interference", type=float,
                         default=SimConfig().interference_per_neighbor,
                         help="step slowdown per busy co-located replica (the MME and "
                              "Static placers are told the same factor)")
        add_json_flag(cmd)
        cmd.set_defaults(func=func)
        if name == "elastic":
            cmd.add_argument("--rate", type=float, default=2.0,
                             help="requests/s of each active model")
        if name == "fidelity":
            cmd.add_argument("--url", default=None,
                             help="live endpoint (default: start a one-model fleet)")
            cmd.add_argument("--profile", default=None,
                             help="stored profile of the served model (default: "
                                  "profiles/llama-tiny--bf16--cpu-http.json, measured through "
                                  "the fleet by `fineslab.profile measure --via http`)")
            cmd.add_argument("--served-model", default=None, help="`model` field to send")
            cmd.add_argument("--calibrate", action="store_true",
                             help="also re-measure the endpoint just before the run and "
                                  "simulate with that profile too")
            cmd.add_argument("--repeats", type=repeats_arg, default=None,
                             help="live runs of the workload, reported as their median with "
                                  "min and max (default 3; --quick: 1)")
    return parser




def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("fineslab.slabs").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

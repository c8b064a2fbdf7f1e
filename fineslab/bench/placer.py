"""Benchmark: time to place N models on G GPUs with each placer (FineServe's and baselines').

    python -m fineslab.bench.placer [--models 200] [--gpus 64] [--repeats 3] [--json]

Models are drawn (seeded) from the committed analytical H100 profiles of the 8B-class variants
(FP16, FP8, AWQ, QoQ: 200 models on 64 GPUs is about three per GPU) with rates of 0.1-2 req/s
and TTFT SLOs of 1-5 s; GPUs are H100s with 90% of their memory usable. Reports the best of
`--repeats` wall-clock runs per placer. JSON keys: `mme_seconds` (Algorithm 1, proxy scorer;
target < 1 s), `mme_exact_seconds`, `kvpr_seconds`, `static_seconds`, and per placer the number
of replicas placed and models left unplaced.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from fineslab.scheduler.placement import PLACEMENT_POLICIES, GpuSpec, ModelDemand
from fineslab.scheduler.profile_schema import load_profiles
from fineslab.tables import add_json_flag, emit

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
GIB = 1 << 30


def make_fleet(num_models: int, num_gpus: int, seed: int,
               ) -> tuple[list[ModelDemand], list[GpuSpec]]:
    profiles = load_profiles(PROFILES_DIR)
    h100 = sorted(name for name in profiles if name.endswith("--h100") and "-8b-" in name)
    rng = random.Random(seed)
    models = [ModelDemand(f"m{i:03d}", profiles[rng.choice(h100)],
                          request_rate_per_s=rng.uniform(0.1, 2.0),
                          ttft_slo_s=rng.uniform(1.0, 5.0)) for i in range(num_models)]
    gpus = [GpuSpec(i, int(0.9 * 80 * GIB), "h100") for i in range(num_gpus)]
    return models, gpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.placer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    models, gpus = make_fleet(args.models, args.gpus, args.seed)
    rows, result = [], {"models": args.models, "gpus": args.gpus}
    for name, factory in PLACEMENT_POLICIES.items():
        best_s = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = factory().place(models, gpus, allow_unplaced=True)
            best_s = min(best_s, time.perf_counter() - start)
        key = name.replace("-", "_")
        result[f"{key}_seconds"] = round(best_s, 4)
        result[f"{key}_replicas"] = len(plan.replicas)
        result[f"{key}_unplaced"] = len(plan.unplaced)
        rows.append([name, best_s, len(plan.replicas), len(plan.unplaced)])
    emit(f"placing {args.models} models on {args.gpus} H100s (best of {args.repeats})",
         ["placer", "seconds", "replicas", "unplaced"], rows, result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A weight region's sleep and wake on a GPU arena (CUDA virtual memory), against the link.

`python -m fineslab.bench.cuda_wake --device cuda [--gib N] [--slab-mib M] [--json]`

The mechanism a GPU wake uses (cuda_vmm.py, cuda_region.py), without SGLang: an arena of
2 x `--gib` in slabs of `--slab-mib`, a region of `--gib` filled with random bytes, its host copy
written once, then `--repeats` rounds (5), each a sleep, a wake and a plain copy of the same
size, so that a slow moment of the machine lands on the wake and its baseline alike; each figure
is the median of the rounds with its spread (`<figure>_spread`: median, min, max, n), and
`wake_over_memcpy` the median of the rounds' own ratios:

    sleep_s          `unback`: the region's slabs unmapped and given back to the arena
    map_s            `back`: free slabs taken and mapped under the same addresses
    restore_s        the host copy (kept pinned: `PinnedHostCopy`) copied in
    wake_s           map_s + restore_s
    wake_gib_s       region bytes / wake_s
    memcpy_gib_s     a pinned host-to-device copy of the same size (the link's limit)
    wake_over_memcpy wake_gib_s / memcpy_gib_s (issue #16's target: >= 0.5)
    identical        the woken region's bytes equal the ones written, every round
    same_address     the region's base never moved
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fineslab.bench.repeats import ratios, spread
from fineslab.tables import add_json_flag, emit, repeats_arg

ROUNDS = 5


def measure(device: str, gib: float, slab_mib: int, folder: Path,
            rounds: int = ROUNDS) -> dict[str, Any]:
    import torch

    from fineslab.slabs.arena import ArenaSpec, SlabArena
    from fineslab.slabs.cuda_region import CudaWeightRegion
    from fineslab.slabs.weights import PinnedHostCopy, write_host_copy

    slab_bytes = slab_mib << 20
    nbytes = int(gib * 2**30) // slab_bytes * slab_bytes
    spec = ArenaSpec("wakebench", device, 2 * nbytes, slab_bytes, 8)
    with SlabArena.create(spec, shm_dir=folder) as arena:
        region = CudaWeightRegion(arena.table, arena.backing, "model", nbytes)  # type: ignore[arg-type]
        region.back()
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        region.tensor().copy_(data)
        host_path = folder / "model.weights"
        write_host_copy(region, host_path)
        base, sync = region.base, (lambda: torch.cuda.synchronize(device))
        times: dict[str, list[float]] = {"sleep_s": [], "map_s": [], "restore_s": [],
                                         "memcpy_s": []}
        identical = True
        with PinnedHostCopy(host_path, nbytes) as pinned:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            target = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for _ in range(rounds):
                sync()
                start = time.perf_counter()
                region.unback()
                times["sleep_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                region.back()
                mapped = time.perf_counter()
                pinned.copy_into(region.tensor())
                done = time.perf_counter()
                times["map_s"].append(mapped - start)
                times["restore_s"].append(done - mapped)
                identical &= bool(torch.equal(region.tensor(), data))
                sync()
                start = time.perf_counter()
                target.copy_(host, non_blocking=True)
                sync()
                times["memcpy_s"].append(time.perf_counter() - start)
        same_address = region.base == base
        region.close()
    wakes = [m + r for m, r in zip(times["map_s"], times["restore_s"], strict=True)]
    gib_bytes = nbytes / 2**30
    wake_gib_s = [gib_bytes / w for w in wakes]
    memcpy_gib_s = [gib_bytes / m for m in times["memcpy_s"]]
    over = ratios(times["memcpy_s"], wakes)  # (bytes / wake) / (bytes / memcpy), per round
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(device),
                               "weights_gib": round(gib_bytes, 3), "slab_mib": slab_mib,
                               "slabs": nbytes // slab_bytes, "rounds": rounds}
    for name, values, digits in [("sleep_s", times["sleep_s"], 6), ("map_s", times["map_s"], 6),
                                 ("restore_s", times["restore_s"], 6), ("wake_s", wakes, 6),
                                 ("wake_gib_s", wake_gib_s, 2),
                                 ("memcpy_gib_s", memcpy_gib_s, 2),
                                 ("wake_over_memcpy", over, 3)]:
        figures[name] = round(statistics.median(values), digits)
        figures[f"{name}_spread"] = spread(values, digits)
    return {**figures, "identical": identical, "same_address": same_address}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.cuda_wake",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda[:N] (a GPU is needed)")
    parser.add_argument("--gib", type=float, default=4.0, help="the region's size")
    parser.add_argument("--slab-mib", type=int, default=32, help="slab size, a multiple of 2")
    parser.add_argument("--repeats", type=repeats_arg, default=ROUNDS,
                        help=f"rounds of sleep, wake and the plain copy (default {ROUNDS})")
    add_json_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fineslab-wake-") as folder:
        figures = measure(args.device, args.gib, args.slab_mib, Path(folder), args.repeats)
    emit("a weight region's sleep and wake on a GPU arena (medians of the rounds)",
         ["figure", "value"], [(k, v) for k, v in figures.items() if not k.endswith("_spread")],
         figures, args.json)
    return 0 if figures["identical"] and figures["same_address"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

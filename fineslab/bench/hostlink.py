"""The host link: the wake's restore and the layer streamer's copies against the link's limit.

`python -m fineslab.bench.hostlink --device cpu|cuda [--mib N] [--json]`

A sleeping model's weights come back from its host copy (a file in the page cache, written
once at its first sleep), and a streamed layer (issue #17) is copied from host memory before it
runs. Both are bounded by the host link: memcpy bandwidth on CPU, the PCIe/NVLink-C2C link on a
GPU. In one run, on this machine, with an `--mib`-sized host copy, every copy timed in
`--repeats` interleaved rounds (5), each figure the median of the rounds with its spread
(`<figure>_spread`: median, min, max, n), the ratios the median of the rounds' own:

    memcpy_gib_s          the limit: on CPU a copy between two resident buffers; on CUDA a copy
                          from pinned host memory to the device
    restore_gib_s         `fineslab.slabs.weights.copy_file_into`, the wake's restore as built:
                          the host copy mapped (MAP_POPULATE) and copied into device memory;
                          on CUDA pinned 256 MiB at a time for the copy, then unpinned
    restore_over_memcpy   restore_gib_s / memcpy_gib_s
    CUDA only:
    pageable_restore_gib_s  the mapping copied unpinned (the driver stages it): the first path
    pinned_restore_gib_s  a `PinnedHostCopy` kept open (registered with cudaHostRegister once):
                          what a wake gets when the host copy stays pinned
    register_s            what that registration costs once (pinning every page)
    d2d_gib_s             device-to-device copy of the same size (for scale)
    overlap               a chain of `--layer-mib` copies on a side stream while matmuls run on
                          the default stream: (t_copy + t_compute - t_both) / min(t_copy,
                          t_compute); 1 = fully hidden, 0 = serialized (the streamer's premise)

Every timed copy is checked: the destination's bytes equal the source's (`verified`).
Results go in docs/elastic.md (restore) and docs/streaming.md (overlap).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fineslab.bench.repeats import ratios, spread, timed_rounds
from fineslab.tables import add_json_flag, emit, repeats_arg

REPEATS = 5


def _host_copy(nbytes: int, folder: Path) -> tuple[Path, Any]:
    """A host-copy file of `nbytes` random bytes (in the page cache), and those bytes."""
    import torch

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = folder / "weights.hostcopy"
    data.numpy().tofile(path)
    return path, data


def _rates(gib: float, times: dict[str, list[float]], out: dict[str, Any]) -> None:
    """Each step's GiB/s as `<step>_gib_s` (the median of the rounds) and its spread."""
    for name, seconds in times.items():
        rates = [gib / t for t in seconds]
        out[f"{name}_gib_s"] = round(statistics.median(rates), 3)
        out[f"{name}_gib_s_spread"] = spread(rates, 3)


def _over(times: dict[str, list[float]], name: str, base: str, key: str,
          out: dict[str, Any]) -> None:
    """`key`: the median of the rounds' rate ratios of `name` over `base`, with its spread."""
    over = ratios(times[base], times[name])  # (bytes / t_name) / (bytes / t_base)
    out[key] = round(statistics.median(over), 3)
    out[f"{key}_spread"] = spread(over, 3)


def _overlap(device: str, layer_bytes: int, layers: int, rounds: int) -> dict[str, Any]:
    """Copies on a side stream against matmuls on the default stream."""
    import torch

    src = torch.empty(layer_bytes, dtype=torch.uint8).pin_memory()
    slots = [torch.empty(layer_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device)
    sync = torch.cuda.synchronize

    def copies() -> None:
        with torch.cuda.stream(side):
            for i in range(layers):
                slots[i % 2].copy_(src, non_blocking=True)

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(a, a)

    t_copy = statistics.median(timed_rounds({"copy": copies}, sync, rounds)["copy"])
    matmuls = 1
    while True:  # size the compute to about the copy chain's time
        t_compute = statistics.median(timed_rounds({"c": compute}, sync, rounds)["c"])
        if t_compute >= t_copy or matmuls >= 4096:
            break
        matmuls = max(matmuls + 1, int(matmuls * t_copy / max(t_compute, 1e-6)))

    def both() -> None:
        copies()
        compute()

    times = timed_rounds({"copy": copies, "compute": compute, "both": both}, sync, rounds)
    overlap = [(c + m - b) / min(c, m)
               for c, m, b in zip(times["copy"], times["compute"], times["both"], strict=True)]
    return {"copy_s": round(statistics.median(times["copy"]), 6),
            "compute_s": round(statistics.median(times["compute"]), 6),
            "both_s": round(statistics.median(times["both"]), 6), "matmuls": matmuls,
            "overlap": round(statistics.median(overlap), 3), "overlap_spread": spread(overlap, 3)}


def run(device: str, nbytes: int, layer_bytes: int, rounds: int = REPEATS) -> dict[str, Any]:
    import torch

    from fineslab.slabs.weights import PinnedHostCopy, copy_file_into

    cuda = device == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    gib = nbytes / 2**30
    result: dict[str, Any] = {"device": device, "host_copy_gib": gib, "rounds": rounds}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="fineslab-hostlink-") as folder, \
            contextlib.ExitStack() as held:
        path, data = _host_copy(nbytes, Path(folder))
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # The limit: on CUDA from pinned host memory, on CPU between two resident buffers.
        source = data.pin_memory() if cuda else data.clone()
        steps: dict[str, Callable[[], object]] = {
            "memcpy": (lambda: dst.copy_(source, non_blocking=True)) if cuda
            else (lambda: dst.copy_(source)),
            "restore": lambda: copy_file_into(path, dst)}
        if cuda:
            start_s = time.perf_counter()
            kept = held.enter_context(PinnedHostCopy(path, nbytes))
            result["register_s"] = round(time.perf_counter() - start_s, 6)
            other = torch.empty_like(dst)
            steps.update(pageable_restore=lambda: copy_file_into(path, dst, chunk_bytes=0),
                         pinned_restore=lambda: kept.copy_into(dst),
                         d2d=lambda: other.copy_(dst))
        verified = True
        for name, step in steps.items():  # every copy's bytes checked once
            dst.zero_()
            step()
            sync()
            verified = verified and bool(torch.equal(
                (other if name == "d2d" else dst).cpu(), data))
        times = timed_rounds(steps, sync, rounds)
        _rates(gib, times, result)
        _over(times, "restore", "memcpy", "restore_over_memcpy", result)
        if cuda:
            _over(times, "pinned_restore", "memcpy", "pinned_over_memcpy", result)
            result.update(_overlap(device, layer_bytes, max(1, nbytes // layer_bytes), rounds))
        result["verified"] = verified
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.hostlink",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mib", type=int, default=1024, help="host copy size in MiB (>= 1)")
    parser.add_argument("--layer-mib", type=int, default=64,
                        help="one streamed layer's size in MiB, for the overlap (>= 1)")
    parser.add_argument("--repeats", type=repeats_arg, default=REPEATS,
                        help=f"interleaved rounds of the copies (default {REPEATS})")
    add_json_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.mib < 1 or args.layer_mib < 1:
        raise SystemExit("--mib and --layer-mib must be >= 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("fineslab.bench.hostlink --device cuda: torch sees no CUDA device")
    result = run(args.device, args.mib << 20, args.layer_mib << 20, args.repeats)
    keys = ("memcpy_gib_s", "restore_gib_s", "restore_over_memcpy", "pageable_restore_gib_s",
            "register_s",
            "pinned_restore_gib_s", "pinned_over_memcpy", "d2d_gib_s", "overlap", "verified")
    emit(f"Host link, {args.mib} MiB host copy, {args.device}", ["figure", "value"],
         [[k, result.get(k, "n/a")] for k in keys], result, args.json)


if __name__ == "__main__":
    main()

"""What an idle fleet costs: the CPU its processes use while nobody sends it a request.

    python -m fineslab.bench.idle --fleet-id ID [--seconds S] [--repeats N] [--json]

For a running fleet (its processes found by the fleet's marker in /proc, its launcher by the
run record), each process's CPU time (user + system, /proc/<pid>/stat) is read before and after
`--seconds`, `--repeats` times, and summed by kind:

    launcher      the launcher: the supervisor (tree checks, liveness probes) and the router
    lifeline      each runtime's wrapper (fineslab.lifeline)
    zygote        the fleet's zygote (warm starts)
    server        SGLang's HTTP server and tokenizer manager, one per runtime
    scheduler     SGLang's scheduler, one per runtime (with SGLang's own liveness probe,
                  `/health_generate`, a one-token generation every `probe_interval_s`)
    detokenizer   SGLang's detokenizer
    other         any other process carrying the marker

in percent of one core: the median of the repeats, with min and max (`fineslab.bench.repeats`).
A process that starts or ends during a window counts from when it was first seen. On this
machine idle fleets share the cores with whatever else runs: an idle fleet's cost is what it
takes from them. Measured figures: docs/serving.md, "What an idle fleet costs".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from fineslab.bench.repeats import spread
from fineslab.errors import ConfigError
from fineslab.proctree import (
    ProcessIdentity,
    fleet_processes,
    process_name,
    run_record_path,
    stat_fields,
)
from fineslab.tables import add_json_flag, emit, repeats_arg

KINDS = ("launcher", "lifeline", "zygote", "server", "scheduler", "detokenizer", "other")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def kind_of(pid: int, launcher_pid: int | None) -> str:
    """Which part of the fleet `pid` is (module doc)."""
    if pid == launcher_pid:
        return "launcher"
    name, cmdline = process_name(pid), _cmdline(pid)
    if name.startswith("sglang::sched"):
        return "scheduler"
    if name.startswith("sglang::detok"):
        return "detokenizer"
    if "fineslab.lifeline" in cmdline:
        return "lifeline"
    if "fineslab.zygote" in cmdline:
        return "zygote"
    if "sglang.launch_server" in cmdline:
        return "server"
    return "other"


def launcher_pid(fleet_id: str, shm_dir: Path | None = None) -> int | None:
    """The fleet's live launcher, from its run record; None when there is none."""
    try:
        body = json.loads(run_record_path(fleet_id, shm_dir).read_text())
        launcher = ProcessIdentity(*body["launcher"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return launcher.pid if launcher.pid and launcher.is_alive() else None


def _ticks(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else None


def sample(fleet_id: str, seconds: float, shm_dir: Path | None = None,
           sleep: Any = time.sleep) -> dict[str, Any]:
    """One window: percent of one core by kind, how many processes of each, the launcher's pid."""
    launcher = launcher_pid(fleet_id, shm_dir)
    pids = set(fleet_processes(fleet_id)) | ({launcher} if launcher else set())
    if not pids:
        raise ConfigError(f"no process of fleet {fleet_id!r} runs (no process carries its "
                          "marker and it has no live launcher): is it launched?")
    before = {pid: t for pid in pids if (t := _ticks(pid)) is not None}
    kinds = {pid: kind_of(pid, launcher) for pid in before}
    start = time.monotonic()
    sleep(seconds)
    wall_s = time.monotonic() - start
    for pid in set(fleet_processes(fleet_id)) - set(before):  # started meanwhile
        if (t := _ticks(pid)) is not None:
            before[pid], kinds[pid] = t, kind_of(pid, launcher)
    used: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for pid, was in before.items():
        now = _ticks(pid)
        used[kinds[pid]] += max(0, (now if now is not None else was) - was)
        count[kinds[pid]] += 1
    percent = {k: 100.0 * used[k] / CLOCK_TICKS_PER_S / wall_s for k in KINDS}
    return {"percent": percent, "processes": {k: count[k] for k in KINDS},
            "launcher_pid": launcher}


def run(fleet_id: str, seconds: float, repeats: int, shm_dir: Path | None = None,
        progress: Any = None) -> dict[str, Any]:
    windows = []
    for r in range(repeats):
        windows.append(sample(fleet_id, seconds, shm_dir))
        if progress is not None:
            total = sum(windows[-1]["percent"].values())
            progress(f"window {r + 1} of {repeats}: {total:.1f}% of one core")
    by_kind = {k: spread([w["percent"][k] for w in windows]) for k in KINDS}
    totals = [sum(w["percent"].values()) for w in windows]
    return {"fleet_id": fleet_id, "seconds": seconds, "repeats": repeats,
            "processes": windows[-1]["processes"], "percent_of_one_core": by_kind,
            "total_percent_of_one_core": spread(totals)}


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0 or value > 3600:
        raise argparse.ArgumentTypeError(f"must be in (0, 3600]: {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fineslab.bench.idle",
        description="The CPU a running fleet's processes use while it is idle, by kind "
                    "(launcher, lifelines, zygote, SGLang's servers, schedulers, detokenizers), "
                    "in percent of one core: the median of repeated windows, with min and max.")
    parser.add_argument("--fleet-id", required=True, help="the running fleet's fleet_id")
    parser.add_argument("--seconds", type=_positive, default=30.0,
                        help="length of each window (default 30)")
    parser.add_argument("--repeats", type=repeats_arg, default=3, help="windows (default 3)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    try:
        out = run(args.fleet_id, args.seconds, args.repeats,
                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [[k, out["processes"][k], s["median"], s["min"], s["max"]]
            for k, s in out["percent_of_one_core"].items() if out["processes"][k]]
    total = out["total_percent_of_one_core"]
    rows.append(["all", sum(out["processes"].values()), total["median"], total["min"],
                 total["max"]])
    emit(f"fleet {args.fleet_id!r} idle, {args.repeats} windows of {args.seconds:g} s "
         "(% of one core)", ["kind", "processes", "median", "min", "max"], rows, out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

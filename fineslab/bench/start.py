"""How fast a runtime starts: a plain start against a warm one (forked from the zygote), a
supervised restart after SIGKILL, and the memory each runtime holds (issue #34).

    python -m fineslab.bench.start --json [--repeats 3] [--model llama-tiny]

Each figure is the median of `--repeats` starts, with its spread (min, max):

    cold_start_s     a plain `sglang.launch_server` (fresh interpreter) to its first token
    warm_start_s     the same runtime forked from a ready zygote to its first token
    zygote_ready_s   the zygote's own start (SGLang imported once, paid once per launcher)
    restart_s        a supervised runtime's server SIGKILLed to its first token again (warm),
                     and `restart_plain_s` with warm starts off
    rss_mib / pss_mib per runtime, both paths: the tree's resident memory; PSS splits pages
                     the tree shares with the zygote (or anyone) among their sharers, so it is
                     what one more runtime costs
    warm_phases_s    where a warm start's seconds go: the first time each milestone of
                     SGLang's log was seen after the fork, and the first token

`ratio` = cold / warm (target >= 3, aim 5, on an idle machine). The last line is the JSON
object; results and commands are recorded in docs/serving.md ("Warm starts").
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from fineslab.bench.repeats import interleave, ratios, spread
from fineslab.env import SHARED_ZYGOTE_VAR, ZYGOTE_VAR, FineslabEnv
from fineslab.fleet.config import DeviceConfig, ModelConfig, SupervisionPolicy
from fineslab.fleet.plan import RuntimePlan
from fineslab.fleet.supervisor import SupervisedRuntime, Supervisor
from fineslab.models.generate import ensure_model
from fineslab.proctree import tree_pids_of_group
from fineslab.runtime import ServerProcess, ServerSpec, free_port, prestart_zygote
from fineslab.tables import add_json_flag, emit

logger = logging.getLogger(__name__)

#: Milestones of SGLang's log, in the order a start passes them.
PHASES = (("server_args", "server_args="), ("weights_loaded", "Load weight end"),
          ("kv_allocated", "KV Cache is allocated"), ("http_up", "Uvicorn running"))
EXTRA_ARGS = ("--max-total-tokens", "2048")


def first_token(base_url: str, timeout_s: float = 300.0) -> None:
    """Block until the server answers a 1-token greedy generation."""
    deadline = time.monotonic() + timeout_s
    body = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 1,
                                                               "temperature": 0}}
    while time.monotonic() < deadline:
        try:
            if httpx.post(base_url + "/generate", json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no first token from {base_url} in {timeout_s} s")


def memory_mib(pids: Sequence[int]) -> tuple[float, float]:
    """(RSS, PSS) of `pids` together, in MiB (/proc/<pid>/smaps_rollup)."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return rss / 1024, pss / 1024


class _Milestones:
    """The first time each of `PHASES` shows in a log, polled every 20 ms from a thread."""

    def __init__(self, log_path: Path, start_s: float) -> None:
        self.seen: dict[str, float] = {}
        self._path, self._start_s = log_path, start_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            try:
                text = self._path.read_text(errors="replace")
            except OSError:
                continue
            for name, marker in PHASES:
                if name not in self.seen and marker in text:
                    self.seen[name] = round(time.monotonic() - self._start_s, 2)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.seen


@dataclass(frozen=True)
class StartResult:
    seconds: float
    rss_mib: float
    pss_mib: float
    phases: dict[str, float]


def one_start(model: Path, logs: Path, name: str, warm: bool) -> StartResult:
    """Start one runtime, time it to its first token, read its memory, stop it."""
    log_path = logs / f"{name}.log"
    started = time.monotonic()
    server = ServerProcess(ServerSpec(str(model), free_port(), extra_args=EXTRA_ARGS),
                           log_path, warm=warm)
    milestones = _Milestones(log_path, started)
    try:
        first_token(server.spec.base_url)
        seconds = time.monotonic() - started
        phases = {**milestones.stop(), "first_token": round(seconds, 2)}
        rss, pss = memory_mib(tree_pids_of_group(server.proc.pid))
        if server.start_kind != ("warm" if warm else "plain"):
            raise RuntimeError(f"{name}: asked for a {'warm' if warm else 'plain'} start, got "
                               f"{server.start_kind} (log: {log_path})")
        return StartResult(seconds, rss, pss, phases)
    finally:
        milestones.stop()
        server.stop(grace_s=2)


def _server_pid(group: int) -> int | None:
    """The SGLang server of a runtime's group: the wrapper's child that is not SGLang's own."""
    for pid in tree_pids_of_group(group):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == group:
            return pid
    return None


def restarts(model: Path, logs: Path, repeats: int, warm: bool) -> list[float]:
    """SIGKILL a supervised runtime's server `repeats` times; seconds to its next token."""
    previous = os.environ.get(ZYGOTE_VAR)
    os.environ[ZYGOTE_VAR] = "1" if warm else "0"
    model_cfg = ModelConfig(name="m", path=str(model), ttft_slo_s=5.0, request_rate_per_s=1.0,
                            replicas=1)
    plan = RuntimePlan("m-r0", model_cfg, "", 0,
                       DeviceConfig(name="cpu", kind="cpu", memory_gib=1), None)
    runtime = SupervisedRuntime(plan, ServerSpec(str(model), free_port(), extra_args=EXTRA_ARGS),
                                logs / f"restart-{'warm' if warm else 'plain'}.log")
    up = threading.Event()
    supervisor = Supervisor([runtime], on_down=lambda *_: up.clear(),
                            on_up=lambda *_: up.set(), reclaim=lambda _d: [],
                            progress=logger.info,
                            policy=SupervisionPolicy(stable_after_s=0.5, health_timeout_s=300))
    seconds = []
    try:
        supervisor.start_all()
        up.set()
        supervisor.watch()
        first_token(runtime.spec.base_url)
        for _ in range(repeats):
            time.sleep(1.0)  # serving long enough to count as stable (no back-off)
            assert runtime.process is not None
            server = _server_pid(runtime.process.proc.pid)
            if server is None:
                raise RuntimeError("no SGLang server in the runtime's group")
            killed = time.monotonic()
            os.kill(server, signal.SIGKILL)
            while runtime.process.proc.pid in (None, server) or up.is_set():
                if time.monotonic() - killed > 300:
                    raise TimeoutError("the supervisor did not restart the runtime")
                time.sleep(0.02)
            first_token(runtime.spec.base_url)
            seconds.append(time.monotonic() - killed)
            while not up.is_set():  # the supervisor's own health check, before the next kill
                time.sleep(0.05)
    finally:
        supervisor.stop_all()
        if previous is None:
            os.environ.pop(ZYGOTE_VAR, None)
        else:
            os.environ[ZYGOTE_VAR] = previous
    return seconds


def run(model_name: str, repeats: int, logs: Path,
        progress: Callable[[str], None] = logger.info) -> dict[str, object]:
    model = ensure_model(model_name, FineslabEnv.from_environ().model_cache_dir)
    # A zygote of its own, whose start and memory it measures: not one another process serves.
    os.environ.pop(SHARED_ZYGOTE_VAR, None)
    started = time.monotonic()
    zygote = prestart_zygote(cpu=True)
    if zygote is None:
        raise RuntimeError("no zygote (warm starts off, or it failed to start): see the log")
    zygote_s = time.monotonic() - started
    progress(f"zygote ready in {zygote_s:.1f} s")
    # Interleaved, the first kind rotating, so a change in the machine's load hits both.
    starts = interleave({
        "cold": lambda i: one_start(model, logs, f"cold-{i}", warm=False),
        "warm": lambda i: one_start(model, logs, f"warm-{i}", warm=True)}, repeats,
        progress=lambda kind, i, result: progress(
            f"{kind} start {i + 1}/{repeats}: {result.seconds:.1f} s"))
    cold, warm = starts["cold"], starts["warm"]
    restart_warm = restarts(model, logs, repeats, warm=True)
    progress(f"restarts (warm): {[round(r, 1) for r in restart_warm]}")
    restart_plain = restarts(model, logs, repeats, warm=False)
    progress(f"restarts (plain): {[round(r, 1) for r in restart_plain]}")
    zygote_rss, zygote_pss = memory_mib([zygote.pid] if zygote.pid else [])
    by_time = sorted(warm, key=lambda r: r.seconds)
    cold_by_time = sorted(cold, key=lambda r: r.seconds)
    return {
        "model": model_name, "repeats": repeats, "cpus": os.cpu_count(),
        "cold_start_s": spread([r.seconds for r in cold]),
        "warm_start_s": spread([r.seconds for r in warm]),
        "ratio": round(statistics.median(r.seconds for r in cold)
                       / statistics.median(r.seconds for r in warm), 2),
        "ratio_spread": spread(ratios([r.seconds for r in cold], [r.seconds for r in warm])),
        "zygote_ready_s": round(zygote_s, 2),
        "restart_s": spread(restart_warm), "restart_plain_s": spread(restart_plain),
        "restart_ratio": round(statistics.median(restart_plain)
                               / statistics.median(restart_warm), 2),
        "rss_mib_per_runtime": {"plain": _median(r.rss_mib for r in cold),
                                "warm": _median(r.rss_mib for r in warm)},
        "pss_mib_per_runtime": {"plain": _median(r.pss_mib for r in cold),
                                "warm": _median(r.pss_mib for r in warm)},
        "zygote_mib": {"rss": round(zygote_rss, 1), "pss": round(zygote_pss, 1)},
        "warm_phases_s": by_time[len(by_time) // 2].phases,
        "cold_phases_s": cold_by_time[len(cold_by_time) // 2].phases,
    }


def _median(values: Iterable[float]) -> float:
    return round(statistics.median(values), 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fineslab.bench.start",
        description="Plain against warm (zygote) starts of one SGLang runtime, restarts after "
                    "SIGKILL, and memory per runtime; medians of --repeats.")
    parser.add_argument("--model", default="llama-tiny", help="a generated preset")
    parser.add_argument("--repeats", type=int, default=3, help="starts of each kind (>= 1)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="folder for the runtimes' logs (default: a temporary one)")
    add_json_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop servers
    logs = args.logs or Path(tempfile.mkdtemp(prefix="fineslab-bench-start-"))
    logs.mkdir(parents=True, exist_ok=True)
    result = run(args.model, args.repeats, logs)
    keys = ("cold_start_s", "warm_start_s", "ratio", "zygote_ready_s", "restart_s",
            "restart_plain_s", "restart_ratio", "rss_mib_per_runtime", "pss_mib_per_runtime",
            "zygote_mib", "warm_phases_s", "cold_phases_s")
    emit(f"Runtime starts, {args.model}, {args.repeats} of each, logs in {logs}",
         ["figure", "value"], [[k, result[k]] for k in keys], result, args.json)


if __name__ == "__main__":
    main()

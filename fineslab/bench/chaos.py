"""Chaos: the demo fleet under load while runtimes die and hang, then the launcher is killed.

    python -m fineslab.bench.chaos --json [--duration 120] [--seed 0] [--hog N] [--config YAML]

Starts the fleet (`examples/cpu-demo.yaml` with its own fleet id, a free port, fast liveness
probes), then for `--duration` seconds keeps `--clients` closed-loop clients on loopback sending
small valid requests (completions and chat, streaming or not) while a driver, every
`duration / faults` seconds, does one of: SIGKILL a runtime's server, SIGKILL its scheduler,
SIGSTOP its server, SIGSTOP its scheduler, a burst of hostile and fuzzed bodies
(`fineslab.bench.fuzz_cases`), clients that leave (`abandon`: ABANDONED long requests whose
clients give up after a second) or requests over a runtime's token budget (`budget`: the first
model runs with `--max-total-tokens` BUDGET_TOKENS; prompts that cannot fit it). Then it waits
for every model to serve again, checks the slab table, SIGKILLs the launcher, checks what is
left, relaunches the same config, and stops it with SIGINT. `--hog N` keeps N busy processes
beside the fleet for the whole run (a machine loaded by other work).

Keys (last line, JSON), target all 0 and `integrity_ok` true:
    requests         requests the clients sent
    unexpected_5xx   5xx other than 502/503/504 for a request that overlapped a fault of its
                     model (from the fault until the model was seen serving again)
    hung_requests    requests with no answer within upstream_timeout_s + 10 s
    models_retired   models not serving at the end (after `--settle-s`)
    leaked_slabs     slabs held by runtimes that are gone (slab table, before the launcher kill)
    orphans          processes carrying the fleet's marker left after the launcher's SIGKILL
                     (+ after the relaunch's stop)
    shm_files_left   SGLang shm files of the fleet's runtimes and arena files left after each
    abandoned_slots  router slots (queued or in flight) still held 10 s after an `abandon`'s
                     clients left, beyond what the other clients hold
    budget_hangs     `budget` requests not answered within 5 s (a 400 is the answer)
    integrity_ok     the slab table's check_integrity, and the relaunch served and stopped
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from fineslab.bench.chaos_fleet import ChaosFleet
from fineslab.bench.fuzz_cases import hostile_cases, random_cases

REPO = Path(__file__).resolve().parents[2]
FAULTS = ("kill_server", "kill_scheduler", "stop_server", "stop_scheduler", "fuzz", "abandon",
          "budget")
#: Requests an `abandon` fault sends and leaves; how long after it looks at the slots.
ABANDONED = 4
ABANDON_CHECK_S = 10.0
#: The first model's token budget (`--max-total-tokens`), and how long a `budget` request may
#: take to be refused.
BUDGET_TOKENS = 1024
BUDGET_ANSWER_S = 5.0
UPSTREAM_TIMEOUT_S = 60.0
FUZZ = "<fuzz>"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of chaos")
    parser.add_argument("--faults", type=int, default=7,
                        help="faults over the duration (7 or more: every kind once)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=600.0,
                        help="how long every model gets to serve again after the chaos")
    parser.add_argument("--config", default=str(REPO / "examples" / "cpu-demo.yaml"))
    parser.add_argument("--hog", type=int, default=0,
                        help="busy processes beside the fleet for the whole run")
    parser.add_argument("--json", action="store_true")
    return parser


class Ledger:
    """Requests and faults, with the rule that tells an expected 502/503/504 from a defect."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, float, float, int | None]] = []  # model, t0, t1, status
        self.faults: list[dict[str, Any]] = []
        # model -> [[start, end, seen_down], ...]: a window closes when the model is seen
        # serving after it was seen down (a SIGSTOPped runtime looks up until found hung).
        self.windows: dict[str, list[list[float]]] = {}
        self.active: Counter[str] = Counter()  # model -> the clients' requests under way
        self.abandoned_slots = 0
        self.budget_hangs = 0

    def fault(self, model: str, kind: str, now_s: float) -> None:
        with self.lock:
            self.faults.append({"model": model, "kind": kind, "at_s": round(now_s, 1)})
            self.windows.setdefault(model, []).append([now_s, float("inf"), 0.0])

    def seen(self, model: str, serving: bool, now_s: float) -> None:
        with self.lock:
            for window in self.windows.get(model, []):
                if window[1] != float("inf"):
                    continue
                if not serving:
                    window[2] = 1.0
                elif window[2]:
                    window[1] = now_s

    def classify(self) -> dict[str, Any]:
        statuses: Counter[str] = Counter()
        unexpected, hung = [], 0
        for model, t0, t1, status in self.requests:
            statuses[str(status)] += 1
            if status is None:
                hung += 1
                continue
            if status < 500:
                continue
            # A fuzzed body may name any model (or none): any model's fault explains it.
            windows = ([w for ws in self.windows.values() for w in ws] if model == FUZZ
                       else self.windows.get(model, []))
            overlaps = any(w[0] <= t1 and t0 <= w[1] for w in windows)
            if status not in (502, 503, 504) or not overlaps:
                unexpected.append({"model": model, "status": status, "at_s": round(t0, 1)})
        return {"requests": len(self.requests), "unexpected_5xx": len(unexpected),
                "hung_requests": hung, "statuses": dict(sorted(statuses.items())),
                "unexpected": unexpected[:10]}


def _client(base_url: str, models: list[str], ledger: Ledger, stop: threading.Event,
            seed: int, clock_0: float) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=UPSTREAM_TIMEOUT_S + 10) as client:
        while not stop.is_set():
            model = rng.choice(models)
            stream = rng.random() < 0.3
            body: dict[str, Any]
            if rng.random() < 0.5:
                path, body = "/v1/completions", {"prompt": "the arena " * rng.randint(1, 20)}
            else:
                path, body = "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "hi " * rng.randint(1, 20)}]}
            body.update(model=model, max_tokens=rng.randint(1, 8), stream=stream)
            t0 = time.monotonic() - clock_0
            status: int | None
            with ledger.lock:
                ledger.active[model] += 1
            try:
                with client.stream("POST", path, json=body) as reply:
                    reply.read()
                    status = reply.status_code
            except httpx.TimeoutException:
                status = None
            except httpx.TransportError:
                status = 599  # a reset: never expected
            with ledger.lock:
                ledger.active[model] -= 1
                ledger.requests.append((model, t0, time.monotonic() - clock_0, status))
            if status in (429, 503):
                time.sleep(0.5)


def _watch_health(fleet: ChaosFleet, ledger: Ledger, stop: threading.Event,
                  clock_0: float) -> None:
    while not stop.wait(1.0):
        status = fleet.model_status()
        for model, state in status.items():
            ledger.seen(model, state == "serving", time.monotonic() - clock_0)


def _inject(fleet: ChaosFleet, kind: str, rng: random.Random, ledger: Ledger,
            clock_0: float) -> None:
    if kind == "fuzz":
        models = fleet.models
        with ledger.lock:
            ledger.faults.append({"model": "*", "kind": kind,
                                  "at_s": round(time.monotonic() - clock_0, 1)})
        cases = hostile_cases(models) + random_cases(models, {}, 40, rng.randrange(2**31))
        with httpx.Client(base_url=fleet.base_url, timeout=60) as client:
            for method, path, body in cases:
                t0 = time.monotonic() - clock_0
                reply = client.request(method, path or "/v1/completions", content=body,
                                       headers={"content-type": "application/json"})
                with ledger.lock:
                    ledger.requests.append((FUZZ, t0, time.monotonic() - clock_0,
                                            reply.status_code))
        return
    if kind == "abandon":
        _abandon(fleet, rng.choice(fleet.models), rng, ledger, clock_0)
        return
    if kind == "budget":
        _over_budget(fleet, ledger, clock_0)
        return
    model = rng.choice(fleet.models)
    target = "scheduler" if kind.endswith("scheduler") else "server"
    pid = fleet.process_of(model, target)
    if pid is None:
        return
    ledger.fault(model, kind, time.monotonic() - clock_0)
    os.kill(pid, signal.SIGKILL if kind.startswith("kill") else signal.SIGSTOP)


def _abandon(fleet: ChaosFleet, model: str, rng: random.Random, ledger: Ledger,
             clock_0: float) -> None:
    """ABANDONED long requests (streamed or not) whose clients leave after a second; then the
    slots the router still holds for the model, beyond the other clients' requests."""
    with ledger.lock:
        ledger.faults.append({"model": model, "kind": "abandon",
                              "at_s": round(time.monotonic() - clock_0, 1)})

    def leave(stream: bool) -> None:
        body = {"model": model, "prompt": "the arena " * 8, "max_tokens": 2000, "stream": stream}
        gone_at = time.monotonic() + 1.0  # a stream's tokens may keep coming: leave anyway
        try:
            with httpx.Client(base_url=fleet.base_url, timeout=1.0) as client, \
                    client.stream("POST", "/v1/completions", json=body) as reply:
                for _ in reply.iter_bytes():
                    if time.monotonic() > gone_at:
                        break
        except httpx.HTTPError:
            pass  # the point: it leaves

    leavers = [threading.Thread(target=leave, args=(rng.random() < 0.5,), daemon=True)
               for _ in range(ABANDONED)]
    for leaver in leavers:
        leaver.start()
    for leaver in leavers:
        leaver.join(10)
    time.sleep(ABANDON_CHECK_S)
    held = fleet.held_slots(model)
    with ledger.lock:
        ledger.abandoned_slots += max(0, held - ledger.active[model])


def _over_budget(fleet: ChaosFleet, ledger: Ledger, clock_0: float) -> None:
    """Requests the first model's token budget cannot hold, each to be refused (400) at once."""
    model = fleet.models[0]
    with ledger.lock:
        ledger.faults.append({"model": model, "kind": "budget",
                              "at_s": round(time.monotonic() - clock_0, 1)})
    for prompt_tokens, max_tokens in ((BUDGET_TOKENS - 14, 24), (BUDGET_TOKENS - 24, 24),
                                      (BUDGET_TOKENS // 2, BUDGET_TOKENS)):
        body = {"model": model, "prompt": [100 + i % 500 for i in range(prompt_tokens)],
                "max_tokens": max_tokens}
        t0 = time.monotonic() - clock_0
        try:
            status = httpx.post(fleet.base_url + "/v1/completions", json=body,
                                timeout=BUDGET_ANSWER_S).status_code
        except httpx.TimeoutException:
            with ledger.lock:
                ledger.budget_hangs += 1
            continue
        with ledger.lock:
            ledger.requests.append((model, t0, time.monotonic() - clock_0, status))


def _schedule(rng: random.Random, count: int) -> list[str]:
    """`count` fault kinds: every kind once in a shuffled round, then again (with `--faults`
    at least the number of kinds, every kind happens)."""
    kinds: list[str] = []
    while len(kinds) < count:
        kinds += rng.sample(FAULTS, len(FAULTS))
    return kinds[:count]


def _hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` processes that burn a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(count)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = yaml.safe_load(Path(args.config).read_text())
    config["fleet_id"] = f"chaos-{os.getpid()}"
    config.setdefault("router", {})["upstream_timeout_s"] = UPSTREAM_TIMEOUT_S
    config["supervision"] = {"probe_interval_s": 2, "probe_timeout_s": 10, "probe_failures": 2}
    first = config["models"][0]
    first["extra_args"] = [*first.get("extra_args", []), "--max-total-tokens",
                           str(BUDGET_TOKENS)]
    folder = Path(tempfile.mkdtemp(prefix="fineslab-chaos-"))
    ledger, result = Ledger(), dict[str, Any]()
    hogs = _hogs(args.hog)
    fleets: list[ChaosFleet] = []
    try:
        fleet = ChaosFleet.launch(config, folder, "first")
        fleets.append(fleet)
        clock_0 = time.monotonic()
        stop = threading.Event()
        workers = [threading.Thread(target=_client, args=(fleet.base_url, fleet.models, ledger,
                                                          stop, args.seed + i, clock_0))
                   for i in range(args.clients)]
        workers.append(threading.Thread(target=_watch_health,
                                        args=(fleet, ledger, stop, clock_0)))
        for worker in workers:
            worker.start()
        gap_s = args.duration / max(1, args.faults)
        for i, kind in enumerate(_schedule(rng, args.faults)):
            time.sleep(gap_s / 2 if i == 0 else gap_s)
            _inject(fleet, kind, rng, ledger, clock_0)
        time.sleep(gap_s / 2)
        stop.set()
        for worker in workers:
            worker.join(UPSTREAM_TIMEOUT_S + 30)
        result.update(ledger.classify(), faults=ledger.faults,
                      abandoned_slots=ledger.abandoned_slots, budget_hangs=ledger.budget_hangs,
                      hog=args.hog, seed=args.seed)
        result["models_retired"] = len(fleet.wait_serving(args.settle_s))
        result["leaked_slabs"], integrity = fleet.slab_check()
        result.update(fleet.kill_launcher_and_count())
        second = ChaosFleet.launch(config, folder, "relaunch")
        fleets.append(second)
        result["relaunch_serving"] = not second.wait_serving(args.settle_s)
        after_stop = second.interrupt()
        result["stop_s"] = after_stop.pop("stop_s")
        for key, value in after_stop.items():
            result[key] += int(value)
        result["integrity_ok"] = integrity and result["relaunch_serving"]
    finally:
        for each in fleets:
            each.cleanup()
        for hog in hogs:
            hog.kill()
            hog.wait()
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    keys = ("requests", "unexpected_5xx", "hung_requests", "models_retired", "leaked_slabs",
            "orphans", "shm_files_left", "abandoned_slots", "budget_hangs", "integrity_ok",
            "statuses", "stop_s")
    for key in keys:
        print(f"{key:>16}: {result.get(key)}")
    for fault in result.get("faults", []):
        print(f"  fault: {fault}")
    if args.json:
        print(json.dumps(result))
    ok = all(result.get(k) == 0 for k in keys[1:9]) and result.get("integrity_ok") is True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

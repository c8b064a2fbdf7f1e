"""SwiftCache's lent tier on a launched CPU fleet: multi-turn TTFT with prefix lending off and on.

    python -m fineslab.bench.prefix [--json] [--quick] [--seed N] [--load moderate|busy]
                                    [--repeats N]

The fleet of examples/cpu-prefix.yaml (one chat model, `chat`, its own KV capped small with
`--max-total-tokens`, and two idle neighbours; with --quick a llama-tiny chat, a smaller arena
and one neighbour) is launched twice, the same sessions driven
through the router each time: first without `prefix_lending` (SGLang's own radix cache), then
with it. Sessions (`fineslab.workload.sessions`, closed loop, interleaved) send each turn as the
whole history (earlier prompts and the model's own replies, as token ids) plus a new message,
streamed. With `--repeats N` (3; 1 with --quick) the two launches are repeated in N interleaved
rounds (off then on, then on then off, ...), and each figure is the median of the rounds, with
its spread (median, min, max, n) as `<figure>_spread`; `ttft_ratio` is the median of the
rounds' own ratios.

Figures (last line, with --json):
    ttft_later_turns_p50_off / _on   median TTFT of turns after the first (s)
    ttft_ratio                       on / off (target <= 0.5)
    hit_rate_off / _on               cached prompt tokens / prompt tokens, later turns
                                     (SGLang's `cached_tokens`: the tree's and the lent tier's)
    lender_reclaim_ms                p99 time for a lender (this process, as a weight owner)
                                     to carve one slab that is lent, after the run "on"
    lender_carve_unlent_ms           p99 of the same carve of a free, unlent slab (the baseline)
    lent_slabs_peak                  the most slabs the chat model held lent during "on"
    carve_alone_ms / carve_during_stores_ms
                                     p99 of a carve in a scratch arena of the fleet's slab
                                     size, alone and while a borrower process stores 8 pages
                                     every 5 ms (the lock wait stores add)

Turn lengths: new input drawn from ShareGPT's prompt lengths divided by `LENGTH_SCALE` (the
stats file in fineslab/workload/data when present, else a seeded log-normal of the same median),
replies `REPLY_TOKENS` long (decode time on CPU is not what this measures).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from fineslab.bench.chaos_fleet import ChaosFleet
from fineslab.bench.repeats import interleave, merge_rounds
from fineslab.errors import ConfigError
from fineslab.tables import repeats_arg
from fineslab.workload.sessions import Session, SessionSpec, build_sessions
from fineslab.workload.traces import SHAREGPT_STATS, LengthTable, load_lengths

logger = logging.getLogger(__name__)

LENGTH_SCALE = 8
REPLY_TOKENS = 16
CHAT = "chat"


@dataclass(frozen=True)
class BenchConfig:
    preset: str = "llama-small"
    own_kv_tokens: int = 1024
    arena_mib: int = 64
    sessions: int = 8
    mean_turns: float = 5.0
    seed: int = 0
    load: str = "moderate"
    #: idle neighbours in the arena beside the chat model (llama-tiny, then qwen2-tiny)
    neighbours: int = 2
    #: interleaved rounds of the two launches (module doc)
    repeats: int = 3


#: (session starts a second, mean think time s): "busy" queues turns behind each other on this
#: CPU (TTFT mostly waiting), "moderate" leaves the prefill to dominate.
LOADS = {"moderate": (0.5, 2.0), "busy": (2.0, 0.5)}

#: One neighbour: each runtime start costs the quick run 20-40 s of this 2-core machine.
QUICK = BenchConfig(preset="llama-tiny", own_kv_tokens=640, arena_mib=16, sessions=4,
                    mean_turns=3.0, neighbours=1, repeats=1)


#: The documented fleet the benchmark launches (with its own settings: `fleet_config`).
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu-prefix.yaml"


def fleet_config(cfg: BenchConfig, lending: bool, fleet_id: str) -> dict[str, Any]:
    """examples/cpu-prefix.yaml, the fleet docs/prefix.md starts, with this run's settings: the
    chat model's preset and own KV tokens, the arena's size, `neighbours` idle models, and
    `prefix_lending` only when `lending` (the defaults leave the file as it is)."""
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    chat, *idle = config["models"]
    if chat["name"] != CHAT or "prefix_lending" not in chat:
        raise ConfigError(f"{EXAMPLE}: its first model is the lending `{CHAT}` model")
    chat["preset"] = cfg.preset
    chat["extra_args"] = ["--max-total-tokens", str(cfg.own_kv_tokens), "--enable-cache-report"]
    if not lending:
        del chat["prefix_lending"]
    config["models"] = [chat, *idle[:cfg.neighbours]]
    config["devices"][0]["kv_arena_mib"] = cfg.arena_mib
    config["fleet_id"] = fleet_id
    return config


def turn_lengths(seed: int) -> LengthTable:
    if SHAREGPT_STATS.exists():
        table = load_lengths(SHAREGPT_STATS, 8192, 1024)
        prompts = np.clip(table.prompt_tokens // LENGTH_SCALE, 16, 384)
    else:
        rng = np.random.default_rng(seed)
        prompts = np.clip(rng.lognormal(np.log(1730 / LENGTH_SCALE), 0.8, 512), 16, 384)
    prompts = prompts.astype(np.int64)
    return LengthTable(prompts, np.full_like(prompts, REPLY_TOKENS))


@dataclass
class TurnResult:
    turn_index: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Drive:
    results: list[TurnResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _stream_turn(base_url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int],
                                                                             int]:
    """One streamed completion: (TTFT s, output token ids, cached prompt tokens)."""
    started = time.perf_counter()
    ttft: float | None = None
    out: list[int] = []
    cached = 0
    body = {"model": CHAT, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(str(chunk["error"])[:300])
            for choice in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - started
                out += choice.get("token_ids") or []
            usage = chunk.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or
                         cached)
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, out, cached


def _run_session(base_url: str, session: Session, vocab: np.random.Generator, clock0: float,
                 drive: Drive) -> None:
    time.sleep(max(0.0, session.start_s - (time.monotonic() - clock0)))
    history: list[int] = []
    for turn in session.turns:
        time.sleep(turn.think_s)
        prompt = history + vocab.integers(10, 1900, turn.input_tokens).tolist()
        try:
            ttft, out, cached = _stream_turn(base_url, prompt, turn.output_tokens)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            with drive.lock:
                drive.errors.append(f"{turn.request_id}: {exc}")
            return
        with drive.lock:
            drive.results.append(TurnResult(turn.turn_index, ttft, len(prompt), cached))
        history = prompt + out


def drive_sessions(base_url: str, sessions: Sequence[Session], seed: int) -> Drive:
    drive, clock0 = Drive(), time.monotonic()
    threads = [threading.Thread(target=_run_session, args=(
        base_url, s, np.random.default_rng([seed, k]), clock0, drive), daemon=True)
        for k, s in enumerate(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(1800)
    return drive


def _percentile_ms(values: Sequence[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 3) if values else float("nan")


def lender_carves(fleet_id: str, samples: int = 32) -> tuple[list[float], list[float], int]:
    """Carve times (s) of a weight owner registered by this process: each free unlent slab,
    then each lent one (the lender's burst), one slab a carve; and how many were lent."""
    from fineslab.slabs.arena import SlabArena
    from fineslab.slabs.table import SlabState
    from fineslab.slabs.weights import carve_weight_slabs, release_weight_slabs

    unlent_s: list[float] = []
    lent_s: list[float] = []
    held: list[np.ndarray] = []
    with SlabArena.attach(fleet_id, "cpu:0") as arena:
        table = arena.table
        slot = table.register("bench-lender:w", table.dims.slab_bytes)
        try:
            while True:
                free = (table.state[1:] == SlabState.FREE)
                lent_now = free & (table.lent_to[1:] != 0)
                if not free.any() or len(lent_s) >= samples:
                    break
                was_lent = bool(lent_now.any()) and not (free & ~lent_now).any()
                started = time.perf_counter()
                held.append(carve_weight_slabs(table, slot, 1))
                (lent_s if was_lent else unlent_s).append(time.perf_counter() - started)
        finally:
            for slabs in held:
                release_weight_slabs(table, slot, slabs, "bench-lender")
            table.unregister(slot)
    return unlent_s, lent_s, len(lent_s)


#: The borrower of `carves_during_stores`, in a process of its own (as a runtime is: in one
#: process the lender would wait on the GIL, not on the table lock).
_STORE_LOOP = """
import sys, time
from pathlib import Path
from fineslab.slabs.arena import SlabArena
from fineslab.slabs.lent import LentPages, set_lend_cap
from fineslab.slabs.weights import carve_weight_slabs
arena = SlabArena.attach("bench-store", "cpu:0", Path(sys.argv[1]))
table, slab = arena.table, arena.spec.slab_bytes
slot = table.register("borrower:w", slab)
own = carve_weight_slabs(table, slot, 8).tolist()
set_lend_cap(table, "borrower:w", table.dims.num_slabs)
lent = LentPages(table, slot, arena.tensor().view(-1, slab), 1)
print("storing", flush=True)
k = 0
while True:  # an eviction of 8 pages every 5 ms: a busy borrower's scheduler steps
    lent.store([f"{k}-{i}".encode() for i in range(len(own))], own)
    k += 1
    time.sleep(0.005)
"""


def carves_during_stores(slab_bytes: int, folder: Path, carves: int = 64
                         ) -> tuple[list[float], list[float]]:
    """A lender's carve times (s) in a scratch arena of the fleet's slab size: alone, then while
    a borrower process stores 8 evicted pages (one a slab) every 5 ms, each slab's copy a lock
    hold of its own (the wait docs/prefix.md discusses)."""
    import subprocess
    import sys

    from fineslab.slabs.arena import ArenaSpec, SlabArena
    from fineslab.slabs.weights import carve_weight_slabs, release_weight_slabs

    spec = ArenaSpec("bench-store", "cpu:0", (2 * carves + 24) * slab_bytes, slab_bytes, 1, 4)
    times: dict[bool, list[float]] = {False: [], True: []}
    with SlabArena.create(spec, shm_dir=folder) as arena:
        table = arena.table
        lender = table.register("lender:w", slab_bytes)
        for storing in (False, True):
            borrower = subprocess.Popen([sys.executable, "-c", _STORE_LOOP, str(folder)],
                                        stdout=subprocess.PIPE, text=True) if storing else None
            try:
                if borrower is not None:
                    assert borrower.stdout is not None
                    assert borrower.stdout.readline().strip() == "storing"
                    time.sleep(0.2)
                held = []
                for _ in range(carves):
                    started = time.perf_counter()
                    held.append(carve_weight_slabs(table, lender, 1))
                    times[storing].append(time.perf_counter() - started)
                    time.sleep(0.002)
                for slabs in held:
                    release_weight_slabs(table, lender, slabs, "lender")
            finally:
                if borrower is not None:
                    borrower.kill()
                    borrower.wait()
        table.reclaim_dead_owners()
    return times[False], times[True]


def _watch_lent(fleet_id: str, stop: threading.Event, peak: list[int]) -> None:
    from fineslab.slabs.arena import SlabArena
    from fineslab.slabs.lent import lent_slabs

    with SlabArena.attach(fleet_id, "cpu:0") as arena:
        while not stop.wait(0.2):
            lent = lent_slabs(arena.table)
            peak[0] = max(peak[0], sum(n for r, n in lent.items() if r.startswith(CHAT + "-")))


def _slab_bytes(fleet_id: str) -> int:
    from fineslab.slabs.arena import SlabArena

    with SlabArena.attach(fleet_id, "cpu:0") as arena:
        return arena.spec.slab_bytes


def run_mode(cfg: BenchConfig, lending: bool, folder: Path, round_: int = 0) -> dict[str, Any]:
    name = "on" if lending else "off"
    fleet_id = f"bench-prefix-{name}-{round_}-{int(time.time())}"
    rate, think = LOADS[cfg.load]
    sessions = build_sessions(SessionSpec(CHAT, turn_lengths(cfg.seed), cfg.sessions, rate,
                                          cfg.mean_turns, 8, think, cfg.own_kv_tokens - 64,
                                          cfg.seed))
    print(f"[prefix] {name}: launching the fleet ({cfg.preset} chat + 2 idle)", flush=True)
    fleet = ChaosFleet.launch(fleet_config(cfg, lending, fleet_id), folder, f"{name}-{round_}")
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=_watch_lent, args=(fleet_id, stop, peak), daemon=True)
    try:
        watcher.start()
        turns = sum(len(s.turns) for s in sessions)
        print(f"[prefix] {name}: {len(sessions)} sessions, {turns} turns", flush=True)
        drive = drive_sessions(fleet.base_url, sessions, cfg.seed)
        stop.set()
        watcher.join(5)
        out: dict[str, Any] = {"drive": drive, "lent_peak": peak[0]}
        if lending:
            out["carves"] = lender_carves(fleet_id)
            out["store_carves"] = carves_during_stores(_slab_bytes(fleet_id), folder)
        fleet.interrupt()
        return out
    finally:
        stop.set()
        fleet.cleanup()


def summarize(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, run in (("off", off), ("on", on)):
        later = [r for r in run["drive"].results if r.turn_index > 0]
        figures[f"ttft_later_turns_p50_{name}"] = round(
            statistics.median([r.ttft_s for r in later]), 4) if later else float("nan")
        prompt = sum(r.prompt_tokens for r in later)
        figures[f"hit_rate_{name}"] = round(sum(r.cached_tokens for r in later) / prompt, 4) \
            if prompt else float("nan")
        figures[f"later_turns_{name}"] = len(later)
        figures[f"errors_{name}"] = len(run["drive"].errors)
    figures["ttft_ratio"] = round(figures["ttft_later_turns_p50_on"]
                                  / figures["ttft_later_turns_p50_off"], 4)
    unlent_s, lent_s, _ = on["carves"]
    figures["lender_reclaim_ms"] = _percentile_ms(lent_s, 99)
    figures["lender_carve_unlent_ms"] = _percentile_ms(unlent_s, 99)
    figures["lender_reclaims"] = len(lent_s)
    figures["lent_slabs_peak"] = on["lent_peak"]
    alone_s, storing_s = on["store_carves"]
    figures["carve_alone_ms"] = _percentile_ms(alone_s, 99)
    figures["carve_during_stores_ms"] = _percentile_ms(storing_s, 99)
    return figures


#: The timed figures, reported with their spread over the rounds.
TIMED = ("ttft_later_turns_p50_off", "ttft_later_turns_p50_on", "ttft_ratio",
         "lender_reclaim_ms", "lender_carve_unlent_ms", "carve_alone_ms", "carve_during_stores_ms")
#: The counts, summed over the rounds.
COUNTS = ("later_turns_off", "later_turns_on", "errors_off", "errors_on", "lender_reclaims")


def summarize_rounds(offs: Sequence[dict[str, Any]], ons: Sequence[dict[str, Any]]
                     ) -> dict[str, Any]:
    """Each round's figures (`summarize`), as their medians, the timed ones with their spread;
    counts (turns, errors) summed, the lent peak the highest."""
    rounds = [summarize(off, on) for off, on in zip(offs, ons, strict=True)]
    return {"rounds": len(rounds),
            **merge_rounds(rounds, rounds[0], summed=COUNTS, highest=("lent_slabs_peak",),
                           with_spread=TIMED)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.prefix",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON last")
    parser.add_argument("--quick", action="store_true",
                        help="llama-tiny, 4 sessions: the short version the tests run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--load", choices=sorted(LOADS), default="moderate",
                        help="session rate and think time (module docstring)")
    parser.add_argument("--repeats", type=repeats_arg, default=None,
                        help="interleaved rounds of the two launches (default 3; --quick: 1)")
    return parser




def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = QUICK if args.quick else BenchConfig()
    cfg = BenchConfig(**{**cfg.__dict__, "seed": args.seed, "load": args.load,
                         "sessions": args.sessions or cfg.sessions,
                         "repeats": args.repeats or cfg.repeats})
    with tempfile.TemporaryDirectory(prefix="fineslab-bench-prefix-") as tmp:
        folder = Path(tmp)
        runs = interleave({"off": lambda r: run_mode(cfg, False, folder, r),
                           "on": lambda r: run_mode(cfg, True, folder, r)}, cfg.repeats)
    figures = {"preset": cfg.preset, "sessions": cfg.sessions, "seed": cfg.seed, "load": cfg.load,
               "lengths": "sharegpt/8" if SHAREGPT_STATS.exists() else "lognormal",
               **summarize_rounds(runs["off"], runs["on"])}
    for run in (*runs["off"], *runs["on"]):
        for error in run["drive"].errors[:5]:
            print(f"[prefix] error: {error}", flush=True)
    for key, value in figures.items():
        print(f"{key:28s} {value}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()

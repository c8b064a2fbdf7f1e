"""SwiftCache's prefix tiers (fineslab/sim/prefix.py), its lenders (lenders.py) and its
experiment, quickly.

Master: Llama-3.1-8B FP16 on an H100 (128 KiB of KV per token), with a small local KV so that
a few sessions overflow it.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from fineslab.scheduler.roofline import analytical_profile

from fineslab.sim.__main__ import main
from fineslab.sim.experiments.common import Traces
from fineslab.sim.experiments.swiftcache import SwiftCacheExpConfig, run_lenders, run_point
from fineslab.sim.lenders import BLOCK_TOKENS, elastic_offers, scale_down, scale_up
from fineslab.sim.prefix import HostTier, LendTier, TierContext, make_tier, simulate_master
from fineslab.workload import (
    AZURE_CONV,
    SHAREGPT_STATS,
    LengthTable,
    SessionSpec,
    build_sessions,
)

TRACES = Traces(Path(SHAREGPT_STATS), Path(AZURE_CONV))
MASTER = analytical_profile("llama-3.1-8b", "fp16", "h100")
B = MASTER.kv_token_bytes
LINKS = (1.0e12, 300e9, 300e9)  # same GPU, then two peers
CTX = TierContext(B, LINKS, host_bytes=4 * 2**30, host_link_bytes_per_s=25e9)


def _sessions(seed: int = 0, num: int = 24) -> tuple[dict, dict]:
    lengths = LengthTable(np.array([300, 1200, 2500, 600]), np.array([80, 200, 120, 40]))
    sessions = build_sessions(SessionSpec("m", lengths, num, 1.0, mean_turns=4.0,
                                          think_mean_s=4.0, seed=seed))
    turns = {s.session_id: [(t.history_tokens, t.input_tokens, t.output_tokens, t.think_s)
                            for t in s.turns] for s in sessions}
    return turns, {s.session_id: s.start_s for s in sessions}


def _run(policy: str, capacity: int, offers: tuple = (), seed: int = 0,
         ctx: TierContext = CTX) -> list[float]:
    turns, starts = _sessions(seed)
    result = simulate_master(MASTER, capacity, turns, starts, make_tier(policy, ctx), 600.0,
                             offers, check=True)
    return [t.ttft_s for t in result.turns]


def test_the_lent_tier_never_holds_more_than_the_lenders_offer() -> None:
    rng = random.Random(7)
    tier = LendTier(CTX)
    offers = [0, 0, 0]
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            lender = rng.randrange(3)
            offers[lender] = rng.randrange(0, 2000) * B
            tier.set_offer(lender, offers[lender], float(step))
        elif op < 0.7:
            tier.store(f"s{rng.randrange(40)}", rng.randrange(1, 1500), float(step))
        else:
            tier.take(f"s{rng.randrange(40)}")
        tier.check_integrity()
        for lender, offer in zip(tier.lenders, offers, strict=True):
            assert lender.lent_bytes <= offer, f"step {step}: lent over the offer"
    assert tier.drops > 0 and tier.dropped_tokens > 0, "control: reclaims did drop pieces"


def test_a_lenders_own_demand_wins_at_once_and_keeps_the_prefix_before_it() -> None:
    tier = LendTier(CTX)
    tier.set_offer(0, 100 * B, 0.0)
    tier.set_offer(1, 1000 * B, 0.0)
    assert tier.store("a", 300, 0.0) == 300, "100 tokens on the same GPU, 200 on a peer"
    assert tier.sessions["a"] == [(0, 100), (1, 200)]
    tier.set_offer(1, 50 * B, 1.0)  # the peer needs its memory back
    assert tier.lenders[1].lent_bytes == 0 and tier.drops == 1 and tier.dropped_tokens == 200
    assert tier.sessions["a"] == [(0, 100)], "the piece before the reclaimed one still serves"
    fetch = tier.take("a")
    assert fetch.tokens == 100, "the surviving prefix reloads, the rest is recomputed"
    tier.store("b", 100, 2.0)
    tier.set_offer(0, 0, 3.0)
    assert "b" not in tier.sessions and tier.drops == 2, "a first piece lost: nothing left"
    tier.check_integrity()


def test_lending_with_no_free_memory_is_recompute_exactly() -> None:
    no_room = tuple((0.0, lender, 0) for lender in range(len(LINKS)))
    recompute = _run("recompute", 12_000)
    assert _run("lend", 12_000, no_room) == recompute, "negative control: nothing lent"
    assert _run("lend", 12_000) == recompute, "no offer at all: the same"
    room = tuple((0.0, lender, 10**6 * B) for lender in range(len(LINKS)))
    assert _run("lend", 12_000, room) != recompute, "control: the capacity does bind"


def test_with_room_for_every_history_the_policies_coincide() -> None:
    huge = 10**7
    room = tuple((0.0, lender, 10**6 * B) for lender in range(len(LINKS)))
    recompute = _run("recompute", huge)
    assert _run("host", huge) == recompute
    assert _run("lend", huge, room) == recompute
    assert all(math.isfinite(t) for t in recompute), "every turn served"


def test_a_reload_takes_its_bytes_over_its_links_bandwidth() -> None:
    lend = LendTier(CTX)
    lend.set_offer(0, 1000 * B, 0.0)
    lend.set_offer(1, 5000 * B, 0.0)
    lend.store("a", 3000, 0.0)
    fetch = lend.take("a")
    assert fetch.load_s == pytest.approx(1000 * B / LINKS[0] + 2000 * B / LINKS[1])
    assert lend.reloaded_bytes == 3000 * B
    host = HostTier(CTX)
    host.store("a", 3000, 0.0)
    assert host.take("a").load_s == pytest.approx(3000 * B / 25e9)


def test_lent_histories_cut_ttft_against_recompute_and_host() -> None:
    room = tuple((0.0, lender, 10**6 * B) for lender in range(len(LINKS)))
    big_host = TierContext(B, LINKS, host_bytes=10**12, host_link_bytes_per_s=25e9)
    lend = sum(_run("lend", 12_000, room))
    host = sum(_run("host", 12_000, ctx=big_host))
    assert lend < host < sum(_run("recompute", 12_000)), \
        "the same hits: NVLink reloads beat PCIe ones, and both beat prefilling again"


def test_algorithm_1_steps_in_whole_elastic_units() -> None:
    assert scale_up(8, 8, 4) == 0 and scale_up(8, 9, 4) == 4 and scale_up(8, 17, 4) == 12
    assert scale_down(8, 8, 4) == 0 and scale_down(8, 3, 4) == 4 and scale_down(8, 0, 4) == 8
    demand = [(0.0, 0), (10.0, 600), (12.0, 0)]
    points = elastic_offers(demand, 1000, 100, 700, window_s=5.0, check_s=1.0, horizon_s=30.0)

    def offer_at(t: float) -> int:
        return [b for s, b in points if s <= t][-1]

    assert offer_at(0.5) == 0, "it starts holding all of its KV"
    assert offer_at(1.0) == 700, "idle: it offers up to the borrower cap"
    assert offer_at(10.0) == 400, "its own 600 (of 1000): it grows at once"
    assert offer_at(16.9) == 400, "it keeps the window's largest demand"
    assert offer_at(17.0) == 700, "a window after the demand ended, it shrinks back"


def test_the_experiment_is_deterministic_per_seed(tmp_path: Path) -> None:
    cfg = SwiftCacheExpConfig(tmp_path, TRACES, duration_s=120.0, check=True)
    lenders = run_lenders(cfg, 0, (1.0, 0.5), MASTER, MASTER.workload, 180.0)
    first = run_point(cfg, 0, 0.3, "lend", lenders, MASTER)
    assert run_point(cfg, 0, 0.3, "lend", lenders, MASTER) == first
    assert run_point(cfg, 1, 0.3, "lend", lenders, MASTER) != first
    assert BLOCK_TOKENS == 16


def test_the_cli_runs_swiftcache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["swiftcache", "--quick", "--duration", "90", "--out", str(tmp_path),
                 "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("lend_vs_host_p99_ttft_reduction", "lend_vs_recompute_p99_ttft_reduction",
                "paper_p99_ttft_reduction_vs_hicache_sharegpt", "worker_ttft_p99_change",
                "l1c0.5_s0_r0.3_lend_ttft_p99_s", "l1c0.5_s0_r0.3_lend_hit_tier",
                "l1c0.1_lend_vs_host_p99_ttft_reduction", "l3c0.5_s1_r0.3_lend_drops"):
        assert key in figures, key
    assert "### Beside the paper" in (tmp_path / "swiftcache.md").read_text()


def test_lenders_taking_memory_back_mid_run_drop_pieces_and_keep_the_books() -> None:
    turns, starts = _sessions()
    offers = tuple((0.0, lender, 10**6 * B) for lender in range(len(LINKS))) + tuple(
        (40.0 + lender, lender, 200 * B) for lender in range(len(LINKS)))
    tier = LendTier(CTX)
    result = simulate_master(MASTER, 12_000, turns, starts, tier, 600.0, offers, check=True)
    assert tier.drops > 0, "the reclaims hit lent histories"
    assert all(x.lent_bytes <= 200 * B for x in tier.lenders), "the lenders' demand won"
    assert all(math.isfinite(t.ttft_s) for t in result.turns), "dropped ones were recomputed"


def test_a_lone_turn_takes_one_prefill_step_then_a_decode_step_per_token() -> None:
    turns = {"s": [(0, 1000, 3, 0.0)]}
    result = simulate_master(MASTER, 10**6, turns, {"s": 1.0}, make_tier("recompute", CTX),
                             60.0, check=True)
    assert result.turns[0].ttft_s == pytest.approx(MASTER.prefill_s(1000))
    decode = MASTER.decode.step_s(1, 1001) + MASTER.decode.step_s(1, 1002)
    assert result.end_s == pytest.approx(1.0 + MASTER.prefill_s(1000) + decode)

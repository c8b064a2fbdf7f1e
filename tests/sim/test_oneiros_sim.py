"""Layer streaming in the simulator (fineslab.sim.streaming) and its experiment, quickly.

Fleet: C2 of the Oneiros paper on a 96 GB GPU (OPT-30b 65%, OPT-6.7b 15%): about 2.4 GB and
1 GB of own KV, so a burst of requests waits for KV unless layers are lent.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from fineslab.bench.loadgen_metrics import RequestOutcome
from fineslab.sim.config import SimConfig
from fineslab.sim.experiments.common import Traces
from fineslab.sim.experiments.oneiros import (
    GPU_BYTES,
    OneirosExpConfig,
    mix_models,
    p99_ttft_s,
    run_oneiros,
)
from fineslab.sim.streaming import StreamingConfig, StreamingSimulator, simulate_streaming
from fineslab.workload import AZURE_CONV, SHAREGPT_STATS, Request

TRACES = Traces(Path(SHAREGPT_STATS), Path(AZURE_CONV))


def _burst() -> list[Request]:
    return [Request(f"r{i}", ("opt-30b", "opt-6.7b")[i % 2], 0.05 * i, 900, 100)
            for i in range(60)]


def test_lending_serves_a_burst_sooner_and_gives_every_layer_back() -> None:
    models = mix_models("C2", TRACES)
    config = SimConfig(check_integrity=True)
    base, base_stats = simulate_streaming(models, GPU_BYTES, _burst(), config,
                                          StreamingConfig(lending=False))
    lend, stats = simulate_streaming(models, GPU_BYTES, _burst(), config, StreamingConfig())
    assert base_stats.layers_lent == 0, "no lending: nothing lent"
    assert stats.layers_lent > 0 and stats.layers_reverted == stats.layers_lent, \
        "layers lent under the burst all went back once its KV emptied"
    for outcomes in (base, lend):
        counts = Counter(o.request_id for o in outcomes)
        assert max(counts.values()) == 1 and len(counts) == 60 and all(
            o.completed for o in outcomes), "every request served once"
    p99 = sorted(o.ttft_s or 0.0 for o in lend)[-1]
    assert p99 < sorted(o.ttft_s or 0.0 for o in base)[-1], "a bigger KV pool queues less"


def test_the_experiment_without_lending_reduces_nothing(tmp_path: Path) -> None:
    cfg = OneirosExpConfig(tmp_path, TRACES, quick=True, duration_s=8.0, seeds=(0,),
                           links=("gh200",))
    control, _ = run_oneiros(cfg, SimConfig(), lending=False)
    assert control["p99_ttft_reduction"] == 0.0, "negative control: the same system twice"
    acceptance, text = run_oneiros(cfg, SimConfig())
    assert "p99_ttft_reduction" in acceptance and "paper" in text
    assert (tmp_path / "oneiros.md").exists()


def test_regression_a_request_beyond_what_lending_can_give_blocked_the_queue_forever() -> None:
    # Bug: with lending on, the allocator's capacity counted every lendable slab, so a request
    # larger than own KV + the other models' caps was never dropped and, at the head of the
    # FCFS queue, starved every request behind it (C2 over PCIe: 1 of 105 served).
    models = mix_models("C2", TRACES)
    config, streaming_config = SimConfig(check_integrity=True), StreamingConfig(link="h100")
    sim = StreamingSimulator(models, GPU_BYTES, config, streaming_config)
    slot = sim.slots["opt-30b"]
    blocks_per_slab = slot.engine.kv.leases[0].blocks_per_slab
    tokens = slot.engine.kv.tokens_per_block * blocks_per_slab * (slot.reach_slabs + 1)
    sim.close()
    assert slot.engine.kv.blocks_for(tokens) <= slot.engine.kv.capacity_blocks, \
        "the case of the bug: the allocator alone would have kept it waiting"
    requests = [Request("big", "opt-30b", 0.0, tokens - 100, 100)] + [
        Request(f"r{i}", "opt-30b", 0.01 * (i + 1), 500, 50) for i in range(10)]
    outcomes, _ = simulate_streaming(models, GPU_BYTES, requests, config, streaming_config)
    by_id = {o.request_id: o for o in outcomes}
    assert by_id["big"].dropped == "larger than its own KV plus what lending can give"
    assert all(by_id[f"r{i}"].completed for i in range(10)), "the rest are served"


def test_p99_ttft_counts_unserved_requests_as_infinite() -> None:
    # Bug: P99 over the served requests only let the arm that dropped every long request
    # (no lending: 30 of 107 served) look faster than the arm that served all 107.
    served = [RequestOutcome(f"r{i}", "m", 0.0, 10, 5, 1.0, 2.0) for i in range(98)]
    unserved = [RequestOutcome(f"d{i}", "m", 0.0, 10, 0, None, None, dropped="too large")
                for i in range(2)]
    assert math.isinf(p99_ttft_s(served + unserved)), "2 % unserved: P99 never reached"
    assert p99_ttft_s(served) == 1.0

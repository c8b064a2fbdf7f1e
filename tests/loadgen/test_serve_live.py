"""The load generator against a real SGLang server on CPU (llama-tiny), and its pure parts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fineslab.bench.serve import main
from fineslab.loadgen.client import ClientConfig
from fineslab.loadgen.metrics import RequestOutcome, summarize
from fineslab.loadgen.run import BenchConfig, run_benchmark
from fineslab.runtime import ServerProcess, ServerSpec, free_port, start_server
from fineslab.workload import Request


def test_summary_counts_drops_as_slo_misses() -> None:
    outcomes = [
        RequestOutcome("a", "m", 0.0, 10, 5, 0.1, 0.5, ttft_slo_s=0.2, itl_s=(0.1, 0.1)),
        RequestOutcome("b", "m", 1.0, 10, 3, 0.3, 0.9, ttft_slo_s=0.2),
        RequestOutcome("c", "m", 2.0, 10, 0, None, None, dropped="HTTP 500", ttft_slo_s=0.2),
    ]
    summary = summarize(outcomes)
    assert summary.num_completed == 2 and summary.num_dropped == 1
    assert summary.slo_attainment == pytest.approx(1 / 3), "met / all, a drop is a miss"
    assert summary.duration_s == pytest.approx(1.9), "first arrival to last completion"
    assert summary.output_tokens_per_s == pytest.approx(8 / 1.9)
    assert summary.tpot_s.p50 == pytest.approx((0.1 + 0.3) / 2)
    assert summary.itl_s.mean == pytest.approx(0.1)


@pytest.fixture(scope="module")
def tiny_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "sglang.log"
    spec = ServerSpec(model_path=str(model_cache / "llama-tiny"), port=free_port(),
                      extra_args=("--max-total-tokens", "4096"))
    server = start_server(spec, log_path=log)
    yield server
    server.stop()


@pytest.mark.slow
def test_twelve_streamed_requests_all_complete_with_exact_lengths(
        tiny_server: ServerProcess, model_cache: Path) -> None:
    requests = [Request(f"r{i}", "tiny", 0.05 * i, 16 + 8 * i, 4 + i) for i in range(12)]
    cfg = BenchConfig(ClientConfig(tiny_server.spec.base_url), slo_s={"tiny": 30.0},
                      served_names={"tiny": str(model_cache / "llama-tiny")},
                      tokenizer=model_cache / "llama-tiny", progress=False)
    result = run_benchmark(cfg, requests)
    by_id = {o.request_id: o for o in result.outcomes}
    assert all(o.completed for o in result.outcomes), [o.dropped for o in result.outcomes]
    for request in requests:
        outcome = by_id[request.request_id]
        assert outcome.output_tokens == request.output_tokens, "ignore_eos: max_tokens exactly"
        assert abs(outcome.prompt_tokens - request.prompt_tokens) <= 2, "prompt built to length"
        assert outcome.ttft_s is not None and outcome.e2e_s is not None
        assert 0 < outcome.ttft_s <= outcome.e2e_s
        assert len(outcome.itl_s) >= 1, "streamed: more than one chunk"
    summary = result.summary()
    assert summary.slo_attainment == 1.0 and summary.output_tokens_per_s > 0


@pytest.mark.slow
def test_cli_writes_json_and_plots(tiny_server: ServerProcess, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--url", tiny_server.spec.base_url, "--rate", "4", "--duration", "3",
                 "--num-requests", "6", "--max-prompt-tokens", "128", "--max-output-tokens",
                 "8", "--slo", "30", "--out", str(tmp_path), "--no-progress", "--json"])
    assert code == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["summary"]["num_completed"] == 6, "the model is discovered from /v1/models"
    assert {"ttft_s", "tpot_s", "itl_s", "e2e_s"} <= set(last["summary"])
    assert (tmp_path / "results.json").exists() and (tmp_path / "ttft_cdf.png").exists()

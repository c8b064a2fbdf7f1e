"""The router's queue feeding a `-margin` policy's drop margin from first streamed tokens
(issue #38), with a fake replica and clock. The gate predicts 10 ms per prompt token; the SLO
is 2 s. A teaching request of 100 tokens is predicted at 1 s and streams its first token 0.5 s
after its lease: ratio 0.5. Then a 300-token request (3 s, 1.5x its 2 s) is leased where the
paper's gate refuses it, and a 600-token one (6 s, 3x) is refused by both."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from types import SimpleNamespace

import httpx
import pytest
from fineslab.scheduler.local import MarginConfig, get_batch_policy

from fineslab.router import Router, RouterServer
from fineslab.router.metrics import RouterMetrics
from fineslab.router.queues import Lease, ModelQueue, RequestDropped
from fineslab.router.routes import ModelRoute, ReplicaRoute, RouterSettings
from fineslab.router.testing import start_echo_backend
from fineslab.runtime import free_port
from tests.serving.test_router_queueing import LinearPredictor


class Gate:
    def __init__(self, policy: str) -> None:
        self.now_s = 100.0
        route = ModelRoute("m", (ReplicaRoute("m-0", "http://x"),), 2.0, LinearPredictor(0.01),
                           None, 4096)
        replica = SimpleNamespace(up=True, inflight=0, runtime_id="m-0",
                                  retry_after_s=lambda: None)
        self.queue = ModelQueue(route, [replica], get_batch_policy(policy),  # type: ignore[list-item]
                                RouterSettings(), RouterMetrics(), clock=lambda: self.now_s)

    async def lease(self, prompt_tokens: int) -> Lease:
        """One request through one dispatcher round; RequestDropped when refused."""
        waiting = asyncio.ensure_future(self.queue.acquire(prompt_tokens))
        await asyncio.sleep(0)
        self.queue.dispatch_once()
        return await waiting

    async def teach(self, count: int, ratio: float = 0.5) -> None:
        for _ in range(count):
            lease = await self.lease(100)  # predicted 1 s
            self.now_s += ratio
            self.queue.first_token(lease, self.now_s)
            self.queue.release(lease)


def test_the_papers_gate_learns_nothing() -> None:
    gate = Gate("adaptive-early-shed")
    asyncio.run(gate.teach(3))
    assert gate.queue.margin is None


def test_each_streamed_first_token_is_one_sample_counted_from_the_lease() -> None:
    gate = Gate("adaptive-early-shed-margin")
    asyncio.run(gate.teach(3))
    assert gate.queue.margin is not None and gate.queue.margin.samples == 3


def test_each_lease_carries_its_ttft_behind_the_batch_leased_before_it() -> None:
    """Leased in one round, the earlier first: 50 tokens at 0.5 s, then 100 tokens at 1.5 s
    (the prefill of both); the paper's gate carries no prediction."""
    async def run(policy: str) -> list[float | None]:
        gate = Gate(policy)
        first = asyncio.ensure_future(gate.queue.acquire(50))
        await asyncio.sleep(0)
        gate.now_s += 0.01
        second = asyncio.ensure_future(gate.queue.acquire(100))
        await asyncio.sleep(0)
        gate.queue.dispatch_once()
        return [(await lease).predicted_ttft_s for lease in (first, second)]

    assert asyncio.run(run("adaptive-margin")) == pytest.approx([0.5, 1.5])
    assert asyncio.run(run("adaptive")) == [None, None]


def test_after_its_first_tokens_the_gate_leases_what_the_papers_refuses() -> None:
    async def run(policy: str) -> list[int]:
        gate = Gate(policy)
        await gate.teach(MarginConfig().min_samples)
        leased = []
        for tokens in (300, 600):
            try:
                gate.queue.release(await gate.lease(tokens))
                leased.append(tokens)
            except RequestDropped as exc:
                assert "even alone" in str(exc)
        return leased

    assert asyncio.run(run("adaptive-early-shed")) == []
    assert asyncio.run(run("adaptive-early-shed-margin")) == [300]
    assert asyncio.run(run("adaptive-margin")) == [300]


def test_a_lease_released_without_a_first_token_counts_as_not_over_predicted() -> None:
    """Not streamed, dropped by the engine, failed: its hold is no TTFT. It counts as a first
    token at its prediction (ratio 1), however soon it ended, so it cannot teach the gate to
    keep more; one first token makes one sample, the release after it none."""
    async def run() -> Gate:
        gate = Gate("adaptive-margin")
        for _ in range(MarginConfig().min_samples):
            lease = await gate.lease(100)
            gate.now_s += 0.1  # an engine drop, answered at once
            gate.queue.release(lease)
        return gate

    gate = asyncio.run(run())
    assert gate.queue.margin is not None
    assert gate.queue.margin.samples == MarginConfig().min_samples
    assert gate.queue.margin.correction(gate.now_s) == pytest.approx(1.0)


def test_the_proxy_feeds_the_margin_each_streamed_first_token() -> None:
    """Through a real router and the echo backend (first token after 0.3 s): the gate predicts
    5 s a prompt token, far too slow, so what the streamed first tokens teach is a correction
    below 1; were they not fed (each lease would end as a release without a first token,
    ratio >= 1), it would stay 1."""
    port = free_port()
    backend = start_echo_backend(port, delay_s=0.3)
    route = ModelRoute("m", (ReplicaRoute("m-0", f"http://127.0.0.1:{port}"),), 10_000.0,
                       LinearPredictor(5.0), None, 256)
    router = Router([route], RouterSettings(batch_policy="adaptive-margin"))
    server = RouterServer(router)
    server.start()
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}

    def stream() -> int:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                          timeout=60) as reply:
            return sum(1 for line in reply.iter_lines() if line.startswith("data:"))

    try:
        count = MarginConfig().min_samples
        with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
            assert list(pool.map(lambda _: stream(), range(count))) == [3] * count
        margin = router.queues["m"].margin
        assert margin is not None and margin.samples == count
        assert margin.correction(time.monotonic()) < 1.0
    finally:
        server.stop()
        backend.terminate()
        backend.wait(10)

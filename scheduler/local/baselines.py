"""Baseline batch policies behind the same protocol as Algorithm 2.

FCFS: arrival order, trimmed to N_max / T_max; no deadlines, nothing dropped (the Static*
baseline's scheduler in the paper).

Moore-Hodgson (Prism's slack-aware arbitration, paper 002 Algorithm 2): requests in EDF order are
appended one at a time to a schedule L in which they would run one after another; the completion
of the k-th is t + sum_{i<=k} TTFT({r_i}). When the request just appended would miss its deadline
the request of L with the longest execution time is evicted. This minimises the number of late
requests when requests run one at a time; it does not account for chunked prefill batching
them, which is the gap Algorithm 2 closes. Evicted requests are deferred, not dropped (Prism
keeps them queued); L is then trimmed to N_max / T_max.
"""

from __future__ import annotations

import heapq

from fineslab.scheduler.local.base import (
    BatchDecision,
    QueueSnapshot,
    TtftPredictor,
    WaitingRequest,
    finish_decision,
    trim,
)


class FcfsBatchPolicy:
    name = "fcfs"

    def decide(self, snapshot: QueueSnapshot, predictor: TtftPredictor) -> BatchDecision:
        ordered = sorted(snapshot.requests, key=lambda r: (r.arrival_s, r.request_id))
        return finish_decision(snapshot, predictor, trim(ordered, snapshot.limits), [])


class MooreHodgsonBatchPolicy:
    name = "moore-hodgson"

    def decide(self, snapshot: QueueSnapshot, predictor: TtftPredictor) -> BatchDecision:
        slo_s = snapshot.ttft_slo_s
        ordered = sorted(snapshot.requests,
                         key=lambda r: (r.deadline_s(slo_s), r.arrival_s, r.request_id))
        schedule: list[WaitingRequest] = []
        evicted: set[str] = set()
        # Max-heap of execution times over the schedule (ties: evict the later one).
        longest: list[tuple[float, int, str]] = []
        completion_s = snapshot.now_s
        for index, request in enumerate(ordered):
            exec_s = predictor.ttft_s([request.prompt_tokens])
            schedule.append(request)
            heapq.heappush(longest, (-exec_s, -index, request.request_id))
            completion_s += exec_s
            if completion_s > request.deadline_s(slo_s):
                neg_exec_s, _, victim_id = heapq.heappop(longest)
                evicted.add(victim_id)
                completion_s += neg_exec_s
        kept = [r for r in schedule if r.request_id not in evicted]
        return finish_decision(snapshot, predictor, trim(kept, snapshot.limits), [])

"""FineServe's SLO-aware adaptive batching (paper Algorithm 2), line by line.

    1-8   d_r = arrival(r) + slo; keep r in S if t + TTFT({r}) < d_r, else drop it
    9     sort S by d_r ascending (EDF; ties by arrival, then id, for determinism)
    10-15 while t + TTFT(S) >= d_front(S): remove the longest request (most prompt tokens) from S
    16    S = trim(S, N_max, T_max)
    17    the rest of W stays waiting (deferred)

Why the batch's finish time and not each request's (Moore-Hodgson's test): with chunked prefill
every request of the batch finishes its prefill together, at t + TTFT(S), so the batch is safe
exactly when the earliest deadline in it is met. Since TTFT is monotone and trim keeps the EDF
head, the admitted batch satisfies t + TTFT(admitted) < min deadline(admitted).

Cost: O(n log n) for the sort plus up to n predictor calls in the removal loop, each over the
remaining batch (O(n)), so O(n^2) in the worst case; a heap keeps the longest request. A queue
of 1,000 requests decides in milliseconds.
"""

from __future__ import annotations

import heapq
import logging

from fineslab.scheduler.local.base import (
    BatchDecision,
    DroppedRequest,
    QueueSnapshot,
    TtftPredictor,
    WaitingRequest,
    finish_decision,
    trim,
)

logger = logging.getLogger(__name__)


class AdaptiveBatchPolicy:
    """Algorithm 2: EDF plus chunked-prefill-aware removal of the longest request."""

    name = "adaptive"

    def decide(self, snapshot: QueueSnapshot, predictor: TtftPredictor) -> BatchDecision:
        feasible, dropped = self._drop_infeasible_alone(snapshot, predictor)
        slo_s = snapshot.ttft_slo_s
        feasible.sort(key=lambda r: (r.deadline_s(slo_s), r.arrival_s, r.request_id))
        kept = self._remove_longest_until_head_meets(snapshot, predictor, feasible)
        return finish_decision(snapshot, predictor, trim(kept, snapshot.limits), dropped)

    @staticmethod
    def _drop_infeasible_alone(snapshot: QueueSnapshot, predictor: TtftPredictor,
                               ) -> tuple[list[WaitingRequest], list[DroppedRequest]]:
        feasible, dropped = [], []
        for request in snapshot.requests:
            deadline_s = request.deadline_s(snapshot.ttft_slo_s)
            ttft_s = predictor.ttft_s([request.prompt_tokens])
            if snapshot.now_s + ttft_s < deadline_s:
                feasible.append(request)
            else:  # (a client reads this: durations, not clock readings)
                left_s = deadline_s - snapshot.now_s
                when = (f"its deadline is {left_s:.2f} s away" if left_s > 0 else
                        f"its deadline passed {-left_s:.2f} s ago")
                dropped.append(DroppedRequest(request, (
                    f"cannot meet its deadline even alone: its first token would take about "
                    f"{ttft_s:.2f} s and {when}")))
        return feasible, dropped

    @staticmethod
    def _remove_longest_until_head_meets(snapshot: QueueSnapshot, predictor: TtftPredictor,
                                         by_deadline: list[WaitingRequest],
                                         ) -> list[WaitingRequest]:
        removed: set[str] = set()
        # Longest first; among equals remove the latest deadline (the end of the EDF order).
        longest = [(-r.prompt_tokens, -i, r.request_id) for i, r in enumerate(by_deadline)]
        heapq.heapify(longest)
        head = 0
        while head < len(by_deadline):
            deadline_s = by_deadline[head].deadline_s(snapshot.ttft_slo_s)
            batch = (r.prompt_tokens for r in by_deadline if r.request_id not in removed)
            if snapshot.now_s + predictor.ttft_s(batch) < deadline_s:
                break
            _, _, request_id = heapq.heappop(longest)
            removed.add(request_id)
            while head < len(by_deadline) and by_deadline[head].request_id in removed:
                head += 1
        return [r for r in by_deadline if r.request_id not in removed]

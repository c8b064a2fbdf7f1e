"""Algorithm 2 plus an early shed: a request that will wait past its deadline for a slot is
dropped on arrival, not at its deadline.

Algorithm 2 (`adaptive`) drops a request when now + TTFT({r}) >= d_r, which ignores the wait
for a request slot: with every slot busy, a request that could be prefilled in time alone waits
until its deadline has all but passed and is only then dropped, after its client waited the
whole SLO for a 429. This peer (`adaptive-early-shed`) runs Algorithm 2 unchanged, then lines
up what it admitted and what it deferred (EDF order) against the caller's forecast of when each
slot frees (`QueueSnapshot.slot_free_in_s`: 0 for a free slot, else from measured service times):

    k-th request of the line (k = 0, 1, ...), n slots, f_i the i-th forecast ascending, s the
    mean service time:   wait_k = f_(k mod n) + (k div n) * s
    drop it now if       now + wait_k + TTFT({r}) >= d_r

A request Algorithm 2 admits into a free slot has wait 0 and is never dropped here; with no
free slot the router calls the policy with N_max = 1 and leases nothing, so its head waits too.

The forecast is an estimate (a mean over past requests, whose lengths vary): a request it drops
might have made its deadline, and one it keeps may still be dropped at its deadline by
Algorithm 2. With no forecast (no completions measured yet, or the simulator) it decides
exactly as Algorithm 2. Cost: O(n) on top of Algorithm 2.
"""

from __future__ import annotations

from fineslab.scheduler.local.adaptive import AdaptiveBatchPolicy
from fineslab.scheduler.local.base import (
    BatchDecision,
    DroppedRequest,
    QueueSnapshot,
    TtftPredictor,
    finish_decision,
)


class EarlyShedBatchPolicy:
    """Algorithm 2, then the deferred requests a slot will not reach in time are dropped."""

    name = "adaptive-early-shed"

    def __init__(self) -> None:
        self._paper = AdaptiveBatchPolicy()

    def decide(self, snapshot: QueueSnapshot, predictor: TtftPredictor) -> BatchDecision:
        decision = self._paper.decide(snapshot, predictor)
        slots = snapshot.slot_free_in_s
        if not slots:
            return decision
        slo_s = snapshot.ttft_slo_s
        line = [*decision.admitted, *sorted(
            decision.deferred, key=lambda r: (r.deadline_s(slo_s), r.arrival_s, r.request_id))]
        shed: list[DroppedRequest] = []
        for k, request in enumerate(line):
            wait_s = slots[k % len(slots)] + (k // len(slots)) * snapshot.mean_service_s
            if wait_s <= 0:
                continue
            first_token_s = snapshot.now_s + wait_s + predictor.ttft_s([request.prompt_tokens])
            if first_token_s >= request.deadline_s(slo_s):
                shed.append(DroppedRequest(request, (
                    f"all {len(slots)} request slots are taken and {k} request(s) are ahead of "
                    f"it: a slot is expected in about {wait_s:.1f} s, so its first token about "
                    f"{first_token_s - request.arrival_s:.1f} s after it arrived, past its "
                    f"{slo_s:g} s target")))
        if not shed:
            return decision
        gone = {d.request.request_id for d in shed}
        admitted = [r for r in decision.admitted if r.request_id not in gone]
        return finish_decision(snapshot, predictor, admitted, (*decision.dropped, *shed))

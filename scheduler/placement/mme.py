"""FineServe's model-to-GPU placement (paper Algorithm 1) with either scorer.

    1  sort replicas by F_M (all ranks) descending          (ties: model name, replica index)
    3  for each replica M:
    4    for each candidate G (a GPU, or an aligned TP group) that fits F_M:
    5      K_rem(G') = T_G - sum_{m in G'} F_m
    6      score(G | M) = proxy (eq 3) or exact (eqs 1-2), see `scoring`
    7    G_M = argmax score (ties: the lowest GPU id)
    8    append (M, G_M); charge F_M on G_M

SLO feasibility alone is settled before the loop (`sizing.size_model`: some profiled batch
meets the rate within the TTFT SLO on the profile's device, else DP replicas) and the
candidates are only GPUs of that device. When the fleet cannot hold what sizing asked for,
`degrade.place_degrading` reruns the loop with fewer replicas or smaller operating points
(beyond the paper: it would leave such a model unplaced).

Co-location (`PlacementConfig.interference_per_neighbor` = f > 0, see `colocation`): line 6
scores each member m with mu_m / (1 + f * load_m(G')), load_m = the sum of its neighbours'
expected busy fractions (rate / capacity at their sized batch, at most 1 each), and line 7
takes the argmax over the candidates on which M and every replica already there keep an
SLO-feasible operating point at that slowdown; only when no candidate does, over all of them.
With f = 0 (the default) both are the paper's lines.
Cost: O(R * C * |G'|) score evaluations for R replicas and C candidates; 200 models on 64 GPUs
take well under a second (fineslab.bench.placer: 0.04-0.08 s; told f = 0.2, 0.48-0.50 s,
which rebuilds each member's MME hull per candidate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from fineslab.scheduler.placement.base import (
    GpuSpec,
    ModelDemand,
    PlacementConfig,
    PlacementPlan,
    ReducedModel,
    UnplacedModel,
)
from fineslab.scheduler.placement.colocation import Colocation
from fineslab.scheduler.placement.degrade import place_degrading
from fineslab.scheduler.placement.scoring import Resident, exact_score, proxy_score
from fineslab.scheduler.placement.state import ClusterState, Replica, to_plan

from fineslab.errors import ConfigError

logger = logging.getLogger(__name__)

Scorer = Callable[[Sequence[Resident], float], float]
SCORERS: dict[str, Scorer] = {"proxy": proxy_score, "exact": exact_score}


def mme_order(replicas: list[Replica]) -> list[Replica]:
    """Algorithm 1, line 1: F_M descending."""
    return sorted(replicas, key=lambda r: (-r.total_fixed_bytes, r.demand.name, r.index))


class MmePlacer:
    """Algorithm 1; `scorer` is "proxy" (eq 3) or "exact" (eqs 1-2); `config` says what
    co-location costs (nothing by default)."""

    def __init__(self, scorer: str = "proxy", config: PlacementConfig | None = None) -> None:
        if scorer not in SCORERS:
            raise ConfigError(f"unknown MME scorer {scorer!r}; known: {sorted(SCORERS)}")
        self.scorer = SCORERS[scorer]
        self.name = "mme" if scorer == "proxy" else f"mme-{scorer}"
        self.config = config or PlacementConfig()

    def place(self, models: Sequence[ModelDemand], gpus: Sequence[GpuSpec], *,
              allow_unplaced: bool = False) -> PlacementPlan:
        state, unplaced, reduced = self.place_into_state(models, gpus, allow_unplaced)
        return to_plan(self.name, state, unplaced, reduced=reduced)

    def place_into_state(self, models: Sequence[ModelDemand], gpus: Sequence[GpuSpec],
                         allow_unplaced: bool = False,
                         ) -> tuple[ClusterState, list[UnplacedModel], list[ReducedModel]]:
        colocation = (Colocation(self.config.interference_per_neighbor)
                      if self.config.interference_per_neighbor > 0 else None)
        return place_degrading(
            models, gpus, lambda replicas: self._place_pass(replicas, gpus, colocation),
            allow_unplaced)

    def _place_pass(self, replicas: list[Replica], gpus: Sequence[GpuSpec],
                    colocation: Colocation | None) -> ClusterState:
        """Algorithm 1 over sized replicas; a replica that fits nowhere is skipped."""
        state = ClusterState(gpus)
        for replica in mme_order(replicas):
            best = self._best_group(state, replica, colocation)
            if best is None:
                continue
            group, score = best
            state.add(replica, group, score)
            logger.debug("placed %s on %s (score %.4g)", replica.resident.key, group, score)
        return state

    def _best_group(self, state: ClusterState, replica: Replica,
                    colocation: Colocation | None) -> tuple[tuple[int, ...], float] | None:
        """Lines 4-7: the best-scoring group, SLO-keeping groups first (with co-location)."""
        best: tuple[tuple[int, ...], float] | None = None
        best_key: tuple[bool, float] | None = None
        for group in state.feasible_groups(replica):
            if colocation is None:
                members, keeps_slos = [*state.group_residents(group), replica.resident], True
            else:
                candidate = colocation.candidate(state, replica, group)
                members, keeps_slos = list(candidate.members), candidate.keeps_slos
            score = self.scorer(members, state.k_rem_after(replica, group))
            if best_key is None or (keeps_slos, score) > best_key:
                best, best_key = (group, score), (keeps_slos, score)
        return best

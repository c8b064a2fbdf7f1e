"""Co-location in the MME placer: the compute a candidate GPU's residents would share.

Algorithm 1 scores memory. Co-located runtimes also share a GPU's SMs and HBM bandwidth, so
each resident runs slower the busier its neighbours are. With f = `PlacementConfig.
interference_per_neighbor` a step lasts alone_s * (1 + f * neighbours busy when it starts)
(the simulator's model); the placer charges each neighbour at its expected busy fraction:

    u_k            = clamp(rate_k / capacity_k(b_k), 0, 1)   b_k: the batch k was sized for,
                     capacity_k(b) = decode tokens/s at b / output tokens (requests/s); the
                     share of time k's engine runs steps if it serves its rate at that batch
    load_m(G')     = sum of u_k over the other replicas on any of m's GPUs once M is on G
                     (a TP replica sees the residents of all its ranks)
    slowdown_m(G') = 1 + f * load_m(G')               expected step time over the time alone

and evaluates a candidate G' (G with M added) for M and for every replica already there:

    mu_m(G')   = mu_m / slowdown_m(G')       the paper's mu_M(G) depends on G: a KV increment
                                             buys tokens at the rate the shared compute runs
    feasible(m, s) = some profiled batch b has capacity(b) / s >= rate per replica
                                          and  TTFT(b) * s <= TTFT SLO
    keeps_slos(G') = no member feasible at its present load (M: alone) is infeasible at
                     load_m(G')

The assumption: a neighbour is busy independently of m, for u_k of the time, at its sized
batch. This is the simulator's slowdown on average, not its worst case (every neighbour busy,
1 + f * n_m): a replica near its compute limit alone then still takes a lightly loaded
neighbour. It ignores that slowing a neighbour also lengthens its busy time (u_k is the
alone fraction; no fixed point is solved) and that busy periods cluster under bursts.

The paper's section 6.1 asks the placer to "allocate sufficient compute resources to each model
in order to satisfy the latency of the compute-intensive prefill phase"; `keeps_slos` is that
check with neighbours' expected load counted. F_M stays the alone-sized footprint (the memory
charge does not change with neighbours). With f = 0 every slowdown is 1, every candidate keeps
its SLOs and the placer is the paper's Algorithm 1 exactly.

Cost per candidate: O(|G'| * (|G'| + B)) for B profiled batch sizes, plus rebuilding each
member's MME hull once more (tens of points).
"""

from __future__ import annotations

from dataclasses import dataclass

from fineslab.scheduler.placement.scoring import Resident
from fineslab.scheduler.placement.state import ClusterState, Replica
from fineslab.scheduler.predictors import ChunkedPrefillPredictor, request_rate_capacity_per_s


@dataclass(frozen=True)
class ComputePoint:
    """One profiled batch size of a model, alone on its GPUs."""

    batch_size: int
    capacity_per_s: float  # requests/s
    ttft_s: float  # b mean prompts arriving together


@dataclass(frozen=True)
class Candidate:
    """A candidate group as the scorer sees it with co-location counted."""

    members: tuple[Resident, ...]  # mu scaled by 1 / slowdown
    keeps_slos: bool


class Colocation:
    """Slowdowns and SLO checks for one placement pass (caches each model's compute points)."""

    def __init__(self, interference_per_neighbor: float) -> None:
        self.per_neighbor = interference_per_neighbor
        self._points: dict[str, dict[int, ComputePoint]] = {}  # by model, then batch size

    def slowdown(self, neighbor_load: float) -> float:
        """1 + f * load: the expected step time over the time alone."""
        return 1.0 + self.per_neighbor * neighbor_load

    def busy_fraction(self, replica: Replica) -> float:
        """u_k: the share of time `replica` runs steps at its sized batch, in [0, 1]."""
        point = replica.point  # sized at a profiled batch, so one of the compute points
        capacity_s = self._compute_points(replica)[point.batch_size].capacity_per_s
        return 1.0 if capacity_s <= 0 else min(1.0, max(0.0, point.rate_per_replica_s
                                                        / capacity_s))

    def neighbor_load(self, state: ClusterState, key: str) -> float:
        """Sum of u_k over the other replicas on the placed replica `key`'s GPUs."""
        return sum(self.busy_fraction(state.replica_of(r.key))
                   for r in state.group_residents(state.gpus_of(key)) if r.key != key)

    def candidate(self, state: ClusterState, replica: Replica,
                  group: tuple[int, ...]) -> Candidate:
        """`replica` on `group`: its members' slowed residents and whether every SLO holds."""
        residents = state.group_residents(group)
        added = self.busy_fraction(replica)
        # (replica, load now, load after): a resident gains M's load; M is alone now.
        loads = []
        for r in residents:
            now = self.neighbor_load(state, r.key)
            loads.append((state.replica_of(r.key), now, now + added))
        loads.append((replica, 0.0,
                      sum(self.busy_fraction(state.replica_of(r.key)) for r in residents)))
        slowed = tuple(m.resident.slowed(self.slowdown(after)) for m, _, after in loads)
        keeps = all(self.feasible(m, self.slowdown(after))
                    or not self.feasible(m, self.slowdown(now)) for m, now, after in loads)
        return Candidate(slowed, keeps)

    def feasible(self, replica: Replica, slowdown: float) -> bool:
        """Some profiled batch meets the replica's rate within its TTFT SLO at `slowdown`."""
        rate_s = replica.point.rate_per_replica_s
        slo_s = replica.demand.ttft_slo_s
        return any(p.capacity_per_s >= rate_s * slowdown and p.ttft_s * slowdown <= slo_s
                   for p in self._compute_points(replica).values())

    def _compute_points(self, replica: Replica) -> dict[int, ComputePoint]:
        """Each profiled batch size of the replica's model, alone (cached per model)."""
        name = replica.demand.name
        if name not in self._points:
            profile = replica.demand.profile
            predictor = ChunkedPrefillPredictor.from_profile(profile)
            prompt, output = profile.workload.prompt_tokens, profile.workload.output_tokens
            self._points[name] = {
                b: ComputePoint(b, request_rate_capacity_per_s(profile, b, output),
                                predictor.ttft_s([prompt] * b))
                for b in (int(x) for x in profile.throughput_tokens_per_s.xs)}
        return self._points[name]

"""The placer's contract: models and GPUs in, a frozen placement plan out.

A `PlacementPolicy` places every `ModelDemand` (a profile, an expected request rate, a TTFT SLO)
on `GpuSpec`s. Its `PlacementPlan` lists each model replica with the GPUs it runs on, its fixed
memory per GPU (F_M: weights, profiled activations, base KV) and the share of each GPU's
contested memory it is expected to use; or, for a model it could not place, the reason. The
launcher reads the plan; `plan.table()` prints it.

Plan invariants (tests check them):

    for each GPU g:  sum(fixed_bytes of replicas on g) <= g.memory_bytes
                     sum(fixed_bytes + contested_share_bytes on g) <= g.memory_bytes
    every model is in `replicas` (one entry per DP replica) or in `unplaced`, never both
    a model in `reduced` is in `replicas`; each replica's operating_point.num_replicas is the
    number of replicas of its model in `replicas`
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from fineslab.scheduler.profile_schema import ModelProfile

from fineslab.errors import ConfigError
from fineslab.tables import format_table

GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuSpec:
    gpu_id: int
    memory_bytes: int
    #: Device kind; a model is only placed on GPUs of its profile's device.
    device: str

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ConfigError(f"GPU {self.gpu_id}: memory_bytes must be positive")


@dataclass(frozen=True)
class PlacementConfig:
    """What a placer is told about the fleet beyond memory.

    interference_per_neighbor: f, the compute slowdown co-location costs. A step of a replica
        with n other replicas on its GPUs lasts up to alone_s * (1 + f * n) (co-located
        runtimes share SMs and HBM bandwidth); the MME placer scores and checks a candidate
        GPU with it, each neighbour counted at its expected busy fraction (`colocation`). It
        is a device property, measured like a profile: the
        paper's section 3 measures two co-located quantized 8B models on an H100 reaching
        1.5x-1.95x the aggregate throughput of one, i.e. f between 0.03 and 0.33. The default 0
        is the paper's Algorithm 1, which scores memory only; the simulator tells the placer
        the factor it simulates with. KVPR (Prism's placer) ignores it.
    """

    interference_per_neighbor: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.interference_per_neighbor < float("inf"):
            raise ConfigError("interference_per_neighbor must be finite and >= 0, got "
                              f"{self.interference_per_neighbor}")


@dataclass(frozen=True)
class ModelDemand:
    """One model to serve: its profile on the target device, expected load and TTFT SLO."""

    name: str
    profile: ModelProfile
    request_rate_per_s: float
    ttft_slo_s: float

    def __post_init__(self) -> None:
        if self.request_rate_per_s <= 0 or self.ttft_slo_s <= 0:
            raise ConfigError(f"model {self.name}: request rate and TTFT SLO must be positive")

    @property
    def tp(self) -> int:
        return self.profile.tp


@dataclass(frozen=True)
class OperatingPoint:
    """The smallest profiled batch whose throughput meets the per-replica rate within the SLO."""

    batch_size: int
    num_replicas: int
    rate_per_replica_s: float
    ttft_s: float
    weights_bytes: int
    activation_bytes: int
    kv_base_bytes: int  # per rank
    #: False for a fallback point (fewer replicas than sizing asked for, or a smaller batch):
    #: its batch does not meet the per-replica rate within the TTFT SLO.
    meets_slo: bool = True

    @property
    def fixed_bytes(self) -> int:
        """F_M per GPU of the replica: weights + activations + base KV."""
        return self.weights_bytes + self.activation_bytes + self.kv_base_bytes


@dataclass(frozen=True)
class ReplicaPlacement:
    model: str
    replica: int
    gpu_ids: tuple[int, ...]
    operating_point: OperatingPoint
    #: Expected share of each of its GPUs' contested memory (bytes per GPU).
    contested_share_bytes: int
    #: Static partitions only: the hard cap per GPU; None where memory is shared.
    partition_bytes: int | None
    score: float

    @property
    def fixed_bytes(self) -> int:
        return self.operating_point.fixed_bytes


@dataclass(frozen=True)
class UnplacedModel:
    model: str
    reason: str


@dataclass(frozen=True)
class ReducedModel:
    """A model placed with less than sizing asked for: fewer DP replicas, or an operating
    point that does not meet its rate within the TTFT SLO."""

    model: str
    placed_replicas: int
    sized_replicas: int
    reason: str


@dataclass(frozen=True)
class PlacementPlan:
    policy: str
    gpus: tuple[GpuSpec, ...]
    replicas: tuple[ReplicaPlacement, ...]
    unplaced: tuple[UnplacedModel, ...]
    reduced: tuple[ReducedModel, ...] = ()

    def replicas_on(self, gpu_id: int) -> list[ReplicaPlacement]:
        return [r for r in self.replicas if gpu_id in r.gpu_ids]

    def fixed_bytes_on(self, gpu_id: int) -> int:
        return sum(r.fixed_bytes for r in self.replicas_on(gpu_id))

    def gpus_of(self, model: str) -> list[tuple[int, ...]]:
        return [r.gpu_ids for r in self.replicas if r.model == model]

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form for the launcher and for logs (bytes as integers)."""
        return {
            "policy": self.policy,
            "gpus": [asdict(g) for g in self.gpus],
            "replicas": [{**asdict(r), "fixed_bytes": r.fixed_bytes} for r in self.replicas],
            "unplaced": [asdict(u) for u in self.unplaced],
            "reduced": [asdict(r) for r in self.reduced],
        }

    def table(self) -> str:
        """One row per replica in placement order, then the reduced and unplaced models."""
        headers = ["order", "model", "replica", "gpus", "batch", "fixed_GiB", "contested_GiB",
                   "partition_GiB", "score"]
        rows: list[list[object]] = []
        for order, r in enumerate(self.replicas, start=1):
            partition = "-" if r.partition_bytes is None else r.partition_bytes / GIB
            rows.append([order, r.model, r.replica, ",".join(map(str, r.gpu_ids)),
                         r.operating_point.batch_size, r.fixed_bytes / GIB,
                         r.contested_share_bytes / GIB, partition, r.score])
        text = f"placement by {self.policy}\n" + format_table(headers, rows)
        for short in self.reduced:
            text += f"\nreduced {short.model}: {short.reason}"
        for u in self.unplaced:
            text += f"\nunplaced {u.model}: {u.reason}"
        return text


class PlacementPolicy(Protocol):
    name: str

    def place(self, models: Sequence[ModelDemand], gpus: Sequence[GpuSpec], *,
              allow_unplaced: bool = False) -> PlacementPlan:
        """Place every model it can, degrading DP replicas and operating points to fit (a
        `ReducedModel` says so). A model that fits nowhere raises `PlacementInfeasible` naming
        it; with `allow_unplaced` it is listed in `unplaced` instead (simulations and
        benchmarks that report what a placer cannot do)."""
        ...

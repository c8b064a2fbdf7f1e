"""The simulator's knobs and the systems it compares, as frozen configs.

A `SystemSpec` names the three policies that make a serving system (placer, local scheduler,
KV mode); the paper's systems are peers in `SYSTEMS`:

    fineslab   MME placer (Algorithm 1)  + adaptive batching (Algorithm 2) + shared slabs
    prism      KVPR placer               + Moore-Hodgson                   + shared slabs
    static     MME placement, partitions   + FCFS                          + static partitions
               proportional to F_M (the "static" placer)
    kvcached   KVPR placer               + Moore-Hodgson                   + kvcached's 2 MB
               pages mapped on demand (`sim.pages`): Prism* without the slabs, so the two
               differ by the memory mechanism alone
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fineslab.errors import ConfigError
from fineslab.scheduler.reclaim import ReclaimConfig

KV_MODES = ("shared", "static", "pages")
MIB = 1 << 20
MAX_MEMORY_FRACTION = 4.0


@dataclass(frozen=True)
class SystemSpec:
    name: str
    placer: str
    batch_policy: str
    kv_mode: str

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ConfigError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")


SYSTEMS: dict[str, SystemSpec] = {
    "fineslab": SystemSpec("fineslab", "mme", "adaptive", "shared"),
    "prism": SystemSpec("prism", "kvpr", "moore-hodgson", "shared"),
    "static": SystemSpec("static", "static", "fcfs", "static"),
    "kvcached": SystemSpec("kvcached", "kvpr", "moore-hodgson", "pages"),
}


def get_system(name: str) -> SystemSpec:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ConfigError(f"unknown system {name!r}; known: {sorted(SYSTEMS)}") from None


@dataclass(frozen=True)
class SimConfig:
    """Engine and fleet parameters (defaults are SGLang's where SGLang has one).

    interference_per_neighbor: a step of a replica lasts alone_s * (1 + f * n), n = the other
        replicas busy on its GPUs when the step starts. Co-located runtimes share SMs and HBM
        bandwidth (MPS-style spatial sharing); the paper (section 3) measures two co-located
        quantized 8B models reaching 1.95x (FP8+FP8) down to about 1.5x the aggregate throughput
        of one, i.e. f between 0.03 and 0.33; 0.2 is in that range. It is a documented
        assumption, not a fit. The placers are told the same factor
        (`PlacementConfig.interference_per_neighbor`), as a deployment would tell them a
        measured device property; the MME and Static placers use it, KVPR does not.
    max_snapshot_requests: the local scheduler sees the oldest this many waiting requests of a
        replica. With one SLO per model EDF order is arrival order, so a longer queue only adds
        requests that would be decided later anyway; the cap keeps a 5,000-deep FCFS queue from
        costing O(n log n) per step.
    page_map_s, page_set_access_s: kvcached's cost to map one 2 MB page (cuMemMap) and to set
        its access (cuMemSetAccess), issue #18's anchors (about 1.5 us and 36 us); only the
        "pages" KV mode pays them (`sim.pages`).
    page_reserve_min, page_reserve_max: kvcached's pre-mapped reserve, in page groups (one
        2 MB page per layer, K and V): KVCACHED_MIN_RESERVED_PAGES / _MAX_ defaults, 5 and 10.
    cpu_cores: the cores of each CPU device (kind "cpu"); None models a CPU like a GPU, with
        the interference factor. Set, a CPU replica's step lasts alone_s * max(1, threads x
        busy replicas on the device, itself included / cores), each replica running
        max(1, cores // replicas on the device) compute threads as the live fleet gives them
        (`fleet.runtimes.cpu_threads_env`): runtimes on a CPU take turns on its cores, they do
        not share SMs. `bench.capacity` sets it to the machine's cores.
    prefix_cache: a replica keeps a finished request's blocks, as SGLang's radix cache keeps
        its KV (no workload here shares a prefix, so the cache is never hit: it only holds
        memory). They go back when the replica's own allocation is short (oldest first) or
        when the launcher's reclaim rule flushes the replica, idle, for a neighbour
        (`scheduler.reclaim`, its thresholds `reclaim`, decided every `reclaim.interval_s` on
        each shared arena). Off (every GPU experiment), blocks are freed when a request ends.
    cache_squeeze: with prefix_cache, the runtimes' own cache squeeze as well
        (`sglang_plugin.cache_squeeze`): a replica whose request finds its arena short asks the
        replicas beside it, and each gives back its oldest cached requests until the asker's
        blocks are free, at its next turn: a busy one when its step ends, an idle one after
        `squeeze_idle_s` on a CPU device (SGLang's idle sleeper wakes once a second: half of
        that on average) and at once on a GPU (its scheduler loop does not sleep).
    gpu_memory_fraction: the part of each GPU's memory the fleet may use. Above 1 (at most
        MAX_MEMORY_FRACTION) it describes a GPU with that much more memory and the same
        compute: `fineslab.sim capacity-parts` uses 1.8 for a fleet whose KV space never binds.
    """

    interference_per_neighbor: float = 0.2
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    max_snapshot_requests: int = 512
    min_slab_bytes: int = 32 * MIB
    gpu_memory_fraction: float = 0.9
    check_integrity: bool = False
    page_map_s: float = 1.5e-6
    page_set_access_s: float = 36e-6
    page_reserve_min: int = 5
    page_reserve_max: int = 10
    cpu_cores: int | None = None
    prefix_cache: bool = False
    reclaim: ReclaimConfig = field(default_factory=ReclaimConfig)
    cache_squeeze: bool = False
    squeeze_idle_s: float = 0.5

    def __post_init__(self) -> None:
        if self.interference_per_neighbor < 0:
            raise ConfigError("interference_per_neighbor must be >= 0")
        if min(self.max_running_requests, self.max_prefill_tokens,
               self.max_snapshot_requests) < 1:
            raise ConfigError("engine limits must be >= 1")
        if not 0 < self.gpu_memory_fraction <= MAX_MEMORY_FRACTION:
            raise ConfigError(f"gpu_memory_fraction must be in (0, {MAX_MEMORY_FRACTION:g}]")
        if min(self.page_map_s, self.page_set_access_s) < 0:
            raise ConfigError("page map times must be >= 0")
        if self.cpu_cores is not None and self.cpu_cores < 1:
            raise ConfigError("cpu_cores must be >= 1 (or None)")
        if not self.squeeze_idle_s >= 0:
            raise ConfigError("squeeze_idle_s must be >= 0")
        if not 0 <= self.page_reserve_min <= self.page_reserve_max:
            raise ConfigError("page reserve sizes must satisfy 0 <= min <= max")

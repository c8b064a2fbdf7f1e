"""Select-N (paper 001): stream the last layer of every i from host memory, within the SLO.

A model whose weights do not all fit (or whose neighbours want the GPU memory) keeps the last
layer of every interval of i layers in host memory and copies it in while the interval's other
i - 1 layers compute. The smallest i that meets the latency SLO puts the most weight bytes in
host memory; this module finds it (offline, the performance record), looks it up (online,
conservatively), and shares one host link among the runtimes that stream over it (the
coordinator). It is pure policy: the copy stream that moves the layers is another module's,
fed `offload_layers`.

Glossary

    L        num_layers of the model
    i        offloading interval; 0: nothing offloaded; 1 refused (every layer would stream:
             DeepSpeed's design, which the paper shows misses SLOs by up to 9.5x)
    k(i)     floor(L / i): layers offloaded (a trailing partial interval stays resident)
    T_T      layer_transfer_s: seconds to copy one layer host -> device
             (= layer_bytes / link bytes/s, or measured)
    T_c      seconds of compute of one layer at (batch, sequence length): the paper's insight
             is that it is the same for every layer and every iteration (section 4.3)

Equations. The paper numbers none of its formulas; they are numbered here, each with the
section or figure it comes from, and the docstrings below cite these numbers.

    (1) offloaded layers     {j : (j + 1) % i == 0, 0 <= j < L}          (section 4.3, fig. 7)
    (2) stall per interval   s(i) = max(0, T_T - (i - 1) * T_c)          (section 4.3: the copy
                             starts with the interval's first layer, overlaps its i - 1
                             resident layers, and the offloaded layer waits for it)
    (3) step time            t(i) = L * T_c + k(i) * s(i);   t(0) = L * T_c
    (4) TTFT = t(i) at the prefill T_c;  TPOT = t(i) at the decode T_c  (section 2.2, 4.4)
    (5) optimal interval     min{i in 2..L : t(i) <= SLO}, else 0 if t(0) <= SLO, else none
                             (section 4.4: "the smallest one that meets the SLO")
    (6) paper's closed form  L_off = floor(L * T_c * (1 + delta) / T_T), i = floor(L / L_off)
                             (section 4.4; reported beside (5), not used to decide)
    (7) stream rate          r(i) = k(i) * layer_bytes / t(i)            (fig. 8, lines 4-13)
    (8) host bytes           h(i) = k(i) * layer_bytes                   (fig. 8, lines 18-27)
    (9) GPU weight footprint F_M(i) = W * (1 - 1/i)                      (issue #17)

Invariants: t(i) is non-increasing in i over 2..L and t(i) >= t(0) (both factors of k(i) * s(i)
are non-increasing and non-negative), so a scan from 2 up finds (5) and every i above the
optimum also meets the SLO. t(i) is non-decreasing in T_c for a fixed i (d t / d T_c is L, or
L - k(i) * (i - 1) >= k(i) while stalling), which is why rounding batch and sequence length up
is a conservative lookup when T_c grows with them.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fineslab.errors import ConfigError

logger = logging.getLogger(__name__)

#: Per-layer compute seconds at (batch, sequence length).
LayerTimeFn = Callable[[int, int], float]
#: The same, measured at grid points: {(batch, seq_len): seconds}.
LayerTimeTable = Mapping[tuple[int, int], float]

#: A step within one part in 1e9 of the SLO meets it: float noise, not slack.
_REL_EPS = 1e-9


def _check_interval(interval: int) -> None:
    if interval == 1:
        raise ConfigError("offloading interval 1 is refused: every layer would stream from "
                          "host memory with no compute to hide the copies; use >= 2, or 0")
    if interval < 0:
        raise ConfigError(f"offloading interval must be 0 (none) or >= 2, got {interval}")


def offload_layers(num_layers: int, interval: int) -> list[int]:
    """The layer indexes kept in host memory at `interval` (equation (1)).

    Layout at L = 8, i = 4 (R resident, H in host memory, streamed in before use):

        layer  0 1 2 3 | 4 5 6 7
               R R R H | R R R H      -> [3, 7]

    Interval 0 offloads nothing. Interval 1 is refused: every layer would stream and no
    compute would hide the copies. An interval above L offloads nothing either (no full
    interval); L % i trailing layers stay resident.
    """
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    _check_interval(interval)
    if interval == 0:
        return []
    return [j for j in range(num_layers) if (j + 1) % interval == 0]


def num_offloaded(num_layers: int, interval: int) -> int:
    """k(i) = floor(L / i), 0 at interval 0 (equation (1) counted)."""
    return len(offload_layers(num_layers, interval))


def step_time_s(num_layers: int, interval: int, layer_transfer_s: float,
                layer_compute_s: float) -> float:
    """One forward pass over all layers at `interval` (equations (2) and (3)).

    Each full interval stalls max(0, T_T - (i - 1) T_c): its copy starts with its first layer
    and only the i - 1 resident layers hide it. The next interval's copy starts only after
    the offloaded layer ran, so copies never queue behind each other on one runtime.
    """
    stall_s = 0.0
    if interval:
        stall_s = max(0.0, layer_transfer_s - (interval - 1) * layer_compute_s)
    return num_layers * layer_compute_s + num_offloaded(num_layers, interval) * stall_s


def smallest_interval(num_layers: int, layer_transfer_s: float, layer_compute_s: float,
                      slo_s: float) -> int | None:
    """Equation (5): the smallest interval whose step meets `slo_s`; 0 when only keeping
    every layer resident does; None when even that misses. Costs at most L step evaluations.
    """
    limit_s = slo_s * (1 + _REL_EPS)
    if step_time_s(num_layers, 0, layer_transfer_s, layer_compute_s) > limit_s:
        return None
    for interval in range(2, num_layers + 1):
        if step_time_s(num_layers, interval, layer_transfer_s, layer_compute_s) <= limit_s:
            return interval
    return 0


def paper_interval_estimate(num_layers: int, layer_transfer_s: float, layer_compute_s: float,
                            slo_quotient: float) -> int:
    """Equation (6), section 4.4's closed form, for comparison only (0: nothing offloaded).

    It counts layers whose copies fit in the slowed step, L * T_c * (1 + delta), as if the copy
    stream never idled; (3) adds that each copy waits for its interval to start. Its floor on
    L / L_off can also offload more than L_off layers (L = 10, L_off = 4 gives i = 2, k = 5),
    and it can answer 1 (DeepSpeed), which `offload_layers` refuses.
    """
    budget_layers = math.floor(num_layers * layer_compute_s * (1 + slo_quotient)
                               / layer_transfer_s)
    return num_layers // budget_layers if budget_layers else 0


def keep_order(interval: int) -> float:
    """Sort key: larger means more layers resident (more conservative); 0 ranks above all."""
    return math.inf if interval == 0 else float(interval)


def most_conservative(a: int | None, b: int | None) -> int | None:
    """The interval keeping more layers resident (`keep_order`); None if either is None."""
    if a is None or b is None:
        return None
    return max(a, b, key=keep_order)


def layer_time_fn(source: LayerTimeFn | LayerTimeTable) -> LayerTimeFn:
    """A per-layer compute time callable from a callable or a measured table."""
    if callable(source):
        return source
    table = dict(source)

    def lookup(batch: int, seq_len: int) -> float:
        try:
            return table[(batch, seq_len)]
        except KeyError:
            raise ConfigError(f"no measured layer time at batch {batch}, sequence length "
                              f"{seq_len}; measured: {sorted(table)}") from None

    return lookup


@dataclass(frozen=True)
class LayerCosts:
    """T_T and T_c of one model on one device: what equations (3) and (4) need.

    `prefill_layer_s(batch, seq_len)` is one layer's compute over the prompts;
    `decode_layer_s(batch, seq_len)` one layer's compute of one decode step at that context.
    Measured (the paper runs one iteration per shape) or profiled (a roofline).
    """

    num_layers: int
    layer_bytes: int
    layer_transfer_s: float
    prefill_layer_s: LayerTimeFn
    decode_layer_s: LayerTimeFn

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.layer_bytes < 1 or self.layer_transfer_s <= 0:
            raise ConfigError("LayerCosts needs num_layers >= 1, layer_bytes >= 1 and "
                              f"layer_transfer_s > 0; got {self.num_layers}, "
                              f"{self.layer_bytes}, {self.layer_transfer_s}")

    @classmethod
    def on_link(cls, num_layers: int, layer_bytes: int, link_bytes_per_s: float,
                prefill: LayerTimeFn | LayerTimeTable,
                decode: LayerTimeFn | LayerTimeTable) -> LayerCosts:
        """T_T = layer_bytes / link_bytes_per_s: the uncontended link (the paper's analyzer
        runs on a server where every GPU has its own bus)."""
        if link_bytes_per_s <= 0:
            raise ConfigError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s}")
        return cls(num_layers, layer_bytes, layer_bytes / link_bytes_per_s,
                   layer_time_fn(prefill), layer_time_fn(decode))

    def ttft_s(self, interval: int, batch: int, seq_len: int) -> float:
        """Equation (4): one prefill step over `batch` prompts of `seq_len` tokens."""
        return step_time_s(self.num_layers, interval, self.layer_transfer_s,
                           self.prefill_layer_s(batch, seq_len))

    def tpot_s(self, interval: int, batch: int, seq_len: int) -> float:
        """Equation (4): one decode step of `batch` sequences at `seq_len` tokens of context."""
        return step_time_s(self.num_layers, interval, self.layer_transfer_s,
                           self.decode_layer_s(batch, seq_len))

    def smallest_interval(self, batch: int, seq_len: int, ttft_slo_s: float,
                          tpot_slo_s: float) -> int | None:
        """Equation (5) for both phases at once: one interval serves prefill and decode, so it
        is the more conservative of the two phase optima (None: no interval meets both)."""
        prefill = smallest_interval(self.num_layers, self.layer_transfer_s,
                                    self.prefill_layer_s(batch, seq_len), ttft_slo_s)
        decode = smallest_interval(self.num_layers, self.layer_transfer_s,
                                   self.decode_layer_s(batch, seq_len), tpot_slo_s)
        return most_conservative(prefill, decode)


def _powers_of_two(name: str, values: Sequence[int]) -> tuple[int, ...]:
    grid = tuple(sorted(set(values)))
    if not grid or any(v < 1 or v & (v - 1) for v in grid):
        raise ConfigError(f"{name} must be non-empty powers of two, got {list(values)}")
    return grid


def _positive(name: str, values: Sequence[float]) -> tuple[float, ...]:
    grid = tuple(sorted(set(values)))
    if not grid or any(v <= 0 for v in grid):
        raise ConfigError(f"{name} must be non-empty and positive, got {list(values)}")
    return grid


def _round_up(grid: tuple[int, ...], value: int) -> int | None:
    at = bisect.bisect_left(grid, value)
    return grid[at] if at < len(grid) else None


def _round_down(grid: tuple[float, ...], value: float) -> float | None:
    at = bisect.bisect_right(grid, value * (1 + _REL_EPS))
    return grid[at - 1] if at else None


GridPoint = tuple[float, float, int, int]  # (ttft_slo_s, tpot_slo_s, batch, seq_len)


class PerformanceRecord:
    """The offline record (section 4.4, table 1): the optimal interval at each grid point.

    Grid: TTFT SLOs x TPOT SLOs (seconds) x batch sizes x sequence lengths (powers of two).
    Each entry is equation (5) for both phases: an interval, 0 (keep every layer), or None
    (no interval meets the SLOs at that point). Building costs |batch| x |seq| T_c
    evaluations and at most L step evaluations per SLO value.

    `lookup` is conservative: batch and sequence length round UP to the next grid value and
    the SLOs round DOWN (a tighter SLO and, by the module's invariant, a slower step only need
    a larger interval). Outside the grid (a shape above the largest grid value, an SLO below
    the smallest) it refuses with None, as a point where nothing meets does: the caller
    serves the request elsewhere (the paper passes it to the upper-level scheduler).
    """

    def __init__(self, ttft_slos_s: Sequence[float], tpot_slos_s: Sequence[float],
                 batch_sizes: Sequence[int], seq_lens: Sequence[int],
                 entries: Mapping[GridPoint, int | None]) -> None:
        self.ttft_slos_s = _positive("ttft_slos_s", ttft_slos_s)
        self.tpot_slos_s = _positive("tpot_slos_s", tpot_slos_s)
        self.batch_sizes = _powers_of_two("batch_sizes", batch_sizes)
        self.seq_lens = _powers_of_two("seq_lens", seq_lens)
        grid = set(itertools.product(self.ttft_slos_s, self.tpot_slos_s, self.batch_sizes,
                                     self.seq_lens))
        if set(entries) != grid:
            raise ConfigError(f"record entries must cover the grid exactly: "
                              f"{len(grid - set(entries))} missing, "
                              f"{len(set(entries) - grid)} outside")
        self._entries = dict(entries)

    @classmethod
    def build(cls, costs: LayerCosts, ttft_slos_s: Sequence[float],
              tpot_slos_s: Sequence[float], batch_sizes: Sequence[int],
              seq_lens: Sequence[int]) -> PerformanceRecord:
        ttft_slos_s, tpot_slos_s = (_positive("ttft_slos_s", ttft_slos_s),
                                    _positive("tpot_slos_s", tpot_slos_s))
        batch_sizes = _powers_of_two("batch_sizes", batch_sizes)
        seq_lens = _powers_of_two("seq_lens", seq_lens)
        entries: dict[GridPoint, int | None] = {}
        for batch, seq_len in itertools.product(batch_sizes, seq_lens):
            prefill_s = costs.prefill_layer_s(batch, seq_len)
            decode_s = costs.decode_layer_s(batch, seq_len)
            prefill = {slo: smallest_interval(costs.num_layers, costs.layer_transfer_s,
                                              prefill_s, slo) for slo in ttft_slos_s}
            decode = {slo: smallest_interval(costs.num_layers, costs.layer_transfer_s,
                                             decode_s, slo) for slo in tpot_slos_s}
            for ttft, tpot in itertools.product(ttft_slos_s, tpot_slos_s):
                entries[(ttft, tpot, batch, seq_len)] = most_conservative(prefill[ttft],
                                                                           decode[tpot])
        return cls(ttft_slos_s, tpot_slos_s, batch_sizes, seq_lens, entries)

    def interval_at(self, point: GridPoint) -> int | None:
        """The entry at a grid point exactly (KeyError off the grid)."""
        return self._entries[point]

    def grid_point(self, ttft_slo_s: float, tpot_slo_s: float, batch: int,
                   seq_len: int) -> GridPoint | None:
        """The grid point a lookup answers from (see the class docstring); None outside."""
        ttft = _round_down(self.ttft_slos_s, ttft_slo_s)
        tpot = _round_down(self.tpot_slos_s, tpot_slo_s)
        rounded_batch = _round_up(self.batch_sizes, batch)
        rounded_seq = _round_up(self.seq_lens, seq_len)
        if ttft is None or tpot is None or rounded_batch is None or rounded_seq is None:
            return None
        return (ttft, tpot, rounded_batch, rounded_seq)

    def lookup(self, ttft_slo_s: float, tpot_slo_s: float, batch: int,
               seq_len: int) -> int | None:
        """The interval to use, conservatively; None: no interval can be promised."""
        point = self.grid_point(ttft_slo_s, tpot_slo_s, batch, seq_len)
        if point is None:
            logger.debug("select-n record: (%g s, %g s, batch %d, seq %d) is outside the grid",
                         ttft_slo_s, tpot_slo_s, batch, seq_len)
            return None
        return self._entries[point]

    def table(self, ttft_slo_s: float, tpot_slo_s: float) -> list[list[int | None]]:
        """Table 1's shape at one SLO pair: a row per batch size, a column per sequence length."""
        return [[self._entries[(ttft_slo_s, tpot_slo_s, b, s)] for s in self.seq_lens]
                for b in self.batch_sizes]


def footprint_bytes(weight_bytes: int, interval: int, num_layers: int | None = None) -> int:
    """GPU bytes of weights at `interval`, for the placer: F_M(i) = W * (1 - 1/i) (eq. (9)).

    With `num_layers`, the layer-exact count instead: the L - k(i) resident layers plus one
    staging buffer the offloaded layer is copied into (one suffices: the next copy starts only
    after the offloaded layer ran). F_M(i) is exact only when i divides L and ignores that
    buffer, so it is a lower bound; W counts the decoder layers only.

    How the placer would use it (it does not yet): size a model's weights as
    footprint_bytes(W, i) with i the record's answer for its SLO at its expected batch, so a
    GPU takes more models; its plan then names each offloaded model and interval (the runtime
    applies it, the coordinator uses i as that model's `max_interval`).
    """
    _check_interval(interval)
    if interval == 0:
        return weight_bytes
    if num_layers is None:
        return math.ceil(weight_bytes * (interval - 1) / interval)
    resident = num_layers - num_offloaded(num_layers, interval)
    staging = 1 if resident < num_layers else 0
    return math.ceil(weight_bytes * (resident + staging) / num_layers)


#: The coordinator refuses a search larger than this (candidates multiplied over runtimes).
MAX_COMBINATIONS = 200_000


@dataclass(frozen=True)
class LinkRuntime:
    """One runtime streaming over the shared host link, as the coordinator sees it now.

    `layer_compute_s` is the decode T_c of its running batch; `max_interval` the largest
    interval its GPU memory holds (None: every layer fits, so 0 is allowed too);
    `min_interval` the smallest it may take for another reason (its TTFT SLO, which the
    coordinator's TPOT test does not see).
    """

    name: str
    num_layers: int
    layer_bytes: int
    layer_compute_s: float
    tpot_slo_s: float
    max_interval: int | None = None
    min_interval: int = 2

    def __post_init__(self) -> None:
        if self.max_interval is not None and self.max_interval < 2:
            raise ConfigError(f"{self.name}: max_interval must be >= 2 or None, "
                              f"got {self.max_interval}")
        if self.min_interval < 2:
            raise ConfigError(f"{self.name}: min_interval must be >= 2, "
                              f"got {self.min_interval}")


@dataclass(frozen=True)
class LinkPlan:
    """The coordinator's decision: an interval per runtime, and what it costs the link."""

    intervals: dict[str, int]
    host_bytes: int
    stream_bytes_per_s: float


class LinkCoordinator:
    """The per-link coordinator (section 4.5, figure 8), for n runtimes instead of two.

    Each runtime's candidates are the intervals that meet its TPOT SLO at the full link's T_T
    (the record's minimum and up) and fit its GPU memory (up to `max_interval`); of those
    with equal k(i) only the smallest is kept (same host bytes, lowest stream rate), so a
    runtime has at most 2 * sqrt(L) + 1. The search is exhaustive over the product, refused
    (ConfigError) above `max_combinations` (at L = 32, ten candidates each: 5 runtimes).
    A combination is valid when its stream rates (7) sum to at most headroom x link bytes/s;
    of the valid ones, the largest host bytes (8) win, then the lowest total rate.

    Like the paper, the rate test is on averages: two copies that start together still share
    the link for a moment; `headroom` < 1 keeps a margin for that. Leave idle runtimes out:
    they stream nothing (the paper then serves the request at its minimum interval).
    """

    def __init__(self, link_bytes_per_s: float, headroom: float = 1.0,
                 max_combinations: int = MAX_COMBINATIONS) -> None:
        if link_bytes_per_s <= 0 or not 0 < headroom <= 1:
            raise ConfigError(f"need link_bytes_per_s > 0 and 0 < headroom <= 1, got "
                              f"{link_bytes_per_s}, {headroom}")
        self.link_bytes_per_s = link_bytes_per_s
        self.headroom = headroom
        self.max_combinations = max_combinations

    def _step_s(self, runtime: LinkRuntime, interval: int) -> float:
        return step_time_s(runtime.num_layers, interval,
                           runtime.layer_bytes / self.link_bytes_per_s, runtime.layer_compute_s)

    def stream_bytes_per_s(self, runtime: LinkRuntime, interval: int) -> float:
        """Equation (7): the bytes/s the runtime's copies take from the link at `interval`."""
        offloaded_bytes = num_offloaded(runtime.num_layers, interval) * runtime.layer_bytes
        return offloaded_bytes / self._step_s(runtime, interval)

    def candidates(self, runtime: LinkRuntime) -> tuple[int, ...]:
        """The intervals the runtime may take, smallest first (0 last); empty: none meets."""
        limit_s = runtime.tpot_slo_s * (1 + _REL_EPS)
        top = min(runtime.num_layers, runtime.max_interval or runtime.num_layers)
        found, seen_k = [], set()
        for interval in range(runtime.min_interval, top + 1):
            k = num_offloaded(runtime.num_layers, interval)
            if k not in seen_k and self._step_s(runtime, interval) <= limit_s:
                found.append(interval)
                seen_k.add(k)
        if runtime.max_interval is None and self._step_s(runtime, 0) <= limit_s:
            found.append(0)
        return tuple(found)

    def plan(self, runtimes: Sequence[LinkRuntime]) -> LinkPlan | None:
        """The intervals that fill host memory most within the link; None: no valid set (a
        runtime meets its SLO at no interval its memory allows, or the link is too slow)."""
        if len({r.name for r in runtimes}) != len(runtimes):
            raise ConfigError(f"runtime names must be unique: {[r.name for r in runtimes]}")
        options = [self.candidates(r) for r in runtimes]
        size = math.prod(len(o) for o in options)
        if size > self.max_combinations:
            raise ConfigError(f"{size} interval combinations over {len(runtimes)} runtimes "
                              f"exceed {self.max_combinations}; split the link's runtimes")
        budget = self.headroom * self.link_bytes_per_s * (1 + _REL_EPS)
        best: tuple[int, float, tuple[int, ...]] | None = None
        for combo in itertools.product(*options):
            rate = sum(self.stream_bytes_per_s(r, i) for r, i in zip(runtimes, combo, strict=True))
            if rate > budget:
                continue
            host = sum(num_offloaded(r.num_layers, i) * r.layer_bytes
                       for r, i in zip(runtimes, combo, strict=True))
            if best is None or (host, -rate) > (best[0], -best[1]):
                best = (host, rate, combo)
        if best is None:
            logger.debug("select-n link: no valid intervals for %s (candidates %s)",
                         [r.name for r in runtimes], options)
            return None
        host, rate, combo = best
        return LinkPlan({r.name: i for r, i in zip(runtimes, combo, strict=True)}, host, rate)

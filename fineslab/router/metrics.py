"""The router's Prometheus metrics, in a registry of its own (one per router).

Counters and histograms are updated on the request path; gauges that mirror live state (queue
lengths, replica health, slab occupancy) are computed at scrape time by `LiveCollector`, so the
request path never pays for them.

    fineslab_queue_length{model}                 waiting requests (scrape time)
    fineslab_requests_admitted_total{model}      released to a runtime by the local scheduler
    fineslab_requests_dropped_total{model,outcome}  outcome: rejected | best_effort | engine (the
                                                    runtime's engine policy dropped it)
    fineslab_requests_failed_total{model,reason} runtime died / unreachable / upstream error
    fineslab_requests_abandoned_total{model}     the client left before its answer ended (the
                                                 request left the queue or was aborted)
    fineslab_ttft_seconds{model}                 router arrival -> first streamed token
    fineslab_tpot_seconds{model}                 mean time per output token after the first
    fineslab_ttft_slo_met_total{model}, fineslab_ttft_measured_total{model}
    fineslab_ttft_slo_attainment{model}          met / measured (streamed requests)
    fineslab_runtime_up{model,runtime}, fineslab_runtime_restarts{model,runtime}
    fineslab_slabs{device,key,state}             slab count by block size (bytes) and state
    fineslab_slab_owner_slabs{device,owner}      slabs a runtime holds alone (a key pool's slabs
                                                 are shared: they are in fineslab_slabs by key)
    fineslab_slab_owner_used_bytes{device,owner} bytes of blocks in use by each runtime
    fineslab_arena_free_bytes{device}
    fineslab_model_state{model,state}            1 for an elastic model's state (awake, asleep,
                                                 sleeping, waking), 0 for the others
    fineslab_sleep_seconds{model}, fineslab_wake_seconds{model}   an elastic model's transitions
    fineslab_evictions_total{model}              sleeps to make room for another model's wake
    fineslab_stream_layers{model,runtime}        layers a streaming model has lent (streams)
    fineslab_stream_lent_bytes{model,runtime}    their bytes, less the slot buffers
    fineslab_stream_streamed_bytes_total{model,runtime}  bytes copied in from the host copy
    fineslab_stream_streamed_bytes_last_step{model,runtime}  ... in the last forward pass
    fineslab_stream_decode_compute_seconds{model,runtime}  a decode pass's compute, less copies
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fineslab.slabs import TableSnapshot
from fineslab.slabs.streamctl import StreamState

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MODEL_STATES = ("awake", "sleeping", "asleep", "waking")
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LiveState(Protocol):
    """What the scrape-time collector reads from the router."""

    def queue_lengths(self) -> dict[str, int]: ...

    def replica_states(self) -> Iterable[tuple[str, str, bool, int]]: ...

    def model_states(self) -> dict[str, str]: ...

    def stream_states(self) -> dict[tuple[str, str], StreamState]: ...


class LiveCollector(Collector):
    def __init__(self, live: LiveState, metrics: RouterMetrics,
                 slabs: Callable[[], dict[str, TableSnapshot]]) -> None:
        self.live, self.metrics, self.slabs = live, metrics, slabs

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily("fineslab_queue_length", "Waiting requests", labels=["model"])
        for model, length in self.live.queue_lengths().items():
            queue.add_metric([model], length)
        yield queue
        attainment = GaugeMetricFamily("fineslab_ttft_slo_attainment",
                                       "Share of measured requests within the TTFT SLO",
                                       labels=["model"])
        for model, (met, measured) in self.metrics.slo_counts.items():
            attainment.add_metric([model], met / measured if measured else 1.0)
        yield attainment
        up = GaugeMetricFamily("fineslab_runtime_up", "1 when the runtime is serving",
                               labels=["model", "runtime"])
        restarts = GaugeMetricFamily("fineslab_runtime_restarts", "Restarts of the runtime",
                                     labels=["model", "runtime"])
        for model, runtime, is_up, num_restarts in self.live.replica_states():
            up.add_metric([model, runtime], 1.0 if is_up else 0.0)
            restarts.add_metric([model, runtime], num_restarts)
        yield up
        yield restarts
        states = GaugeMetricFamily("fineslab_model_state", "1 for an elastic model's state",
                                   labels=["model", "state"])
        for model, state in self.live.model_states().items():
            for name in MODEL_STATES:
                states.add_metric([model, name], 1.0 if name == state else 0.0)
        yield states
        yield from _stream_metrics(self.live.stream_states())
        yield from _slab_metrics(self.slabs())


def _stream_metrics(states: dict[tuple[str, str], StreamState]) -> Iterator[Metric]:
    labels = ["model", "runtime"]
    layers = GaugeMetricFamily("fineslab_stream_layers", "Decoder layers streamed (lent)",
                               labels=labels)
    lent = GaugeMetricFamily("fineslab_stream_lent_bytes",
                             "Weight bytes lent to the arena, less the slot buffers",
                             labels=labels)
    streamed = CounterMetricFamily("fineslab_stream_streamed_bytes",
                                   "Layer bytes copied in from the host copy", labels=labels)
    last = GaugeMetricFamily("fineslab_stream_streamed_bytes_last_step",
                             "Layer bytes copied in during the last forward pass",
                             labels=labels)
    decode = GaugeMetricFamily("fineslab_stream_decode_compute_seconds",
                               "A decode pass's compute, less its copies (moving average; what "
                               "an active model's copies are bounded by)", labels=labels)
    for (model, runtime), state in sorted(states.items()):
        layers.add_metric([model, runtime], len(state.layers))
        lent.add_metric([model, runtime], state.net_lent_bytes)
        streamed.add_metric([model, runtime], state.streamed_bytes)
        last.add_metric([model, runtime], state.streamed_bytes_last_pass)
        decode.add_metric([model, runtime], state.decode_compute_s)
    yield from (layers, lent, streamed, last, decode)


def _slab_metrics(snapshots: dict[str, TableSnapshot]) -> Iterator[Metric]:
    slabs = GaugeMetricFamily("fineslab_slabs", "Slabs by block size (bytes) and state",
                              labels=["device", "key", "state"])
    owner_slabs = GaugeMetricFamily("fineslab_slab_owner_slabs",
                                    "Slabs a runtime holds alone (not its key pool's)",
                                    labels=["device", "owner"])
    owner_used = GaugeMetricFamily("fineslab_slab_owner_used_bytes",
                                   "Bytes of KV blocks in use by a runtime",
                                   labels=["device", "owner"])
    free = GaugeMetricFamily("fineslab_arena_free_bytes", "Bytes in free slabs",
                             labels=["device"])
    limits = GaugeMetricFamily("fineslab_slab_owner_kv_limit_bytes",
                               "A runtime's KV limit (fineslab ctl limit); absent: none",
                               labels=["device", "owner"])
    lent = GaugeMetricFamily("fineslab_slab_owner_lent_slabs",
                             "Free slabs holding a runtime's evicted prefix pages (lent tier)",
                             labels=["device", "owner"])
    for device, snap in snapshots.items():
        for (key, state), count in sorted(snap.slabs_by_key_state.items()):
            slabs.add_metric([device, str(key), state], count)
        for owner in snap.owners:
            # A key pool's slabs hold several runtimes' blocks: counted once, by key, above.
            owner_slabs.add_metric([device, owner.runtime_id], 0 if owner.pooled
                                   else owner.num_slabs)
            owner_used.add_metric([device, owner.runtime_id], owner.used_bytes)
            if owner.kv_limit_bytes is not None:
                limits.add_metric([device, owner.runtime_id], owner.kv_limit_bytes)
            if owner.lent_slabs:
                lent.add_metric([device, owner.runtime_id], owner.lent_slabs)
        free.add_metric([device], snap.free_bytes)
    yield from (slabs, owner_slabs, owner_used, free, limits, lent)


class RouterMetrics:
    """Counters and histograms of one router."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._admitted = Counter("fineslab_requests_admitted", "Requests released to a runtime",
                                 ["model"], registry=r)
        self._dropped = Counter("fineslab_requests_dropped", "Requests the scheduler dropped",
                                ["model", "outcome"], registry=r)
        self._failed = Counter("fineslab_requests_failed", "Requests that ended in an error",
                               ["model", "reason"], registry=r)
        self._abandoned = Counter("fineslab_requests_abandoned",
                                  "Requests whose client left before the answer ended",
                                  ["model"], registry=r)
        self._ttft = Histogram("fineslab_ttft_seconds", "Time to first token at the router",
                               ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._tpot = Histogram("fineslab_tpot_seconds", "Time per output token after the first",
                               ["model"], buckets=TPOT_BUCKETS_S, registry=r)
        self._slo_met = Counter("fineslab_ttft_slo_met", "Requests within the TTFT SLO",
                                ["model"], registry=r)
        self._measured = Counter("fineslab_ttft_measured", "Requests whose TTFT was measured",
                                 ["model"], registry=r)
        self._sleep = Histogram("fineslab_sleep_seconds", "An elastic model's sleep",
                                ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._wake = Histogram("fineslab_wake_seconds", "An elastic model's wake",
                               ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._evictions = Counter("fineslab_evictions", "Sleeps to make room for a wake",
                                  ["model"], registry=r)
        #: model -> (met, measured), for the attainment gauge.
        self.slo_counts: dict[str, tuple[int, int]] = {}

    def register_live(self, collector: LiveCollector) -> None:
        self.registry.register(collector)

    def init_model(self, model: str) -> None:
        """Create every labelled series at zero so that dashboards see the model at once."""
        self._admitted.labels(model)
        self._abandoned.labels(model)
        for outcome in ("rejected", "best_effort"):
            self._dropped.labels(model, outcome)
        self._ttft.labels(model)
        self._tpot.labels(model)
        self._slo_met.labels(model)
        self._measured.labels(model)
        self.slo_counts.setdefault(model, (0, 0))

    def admitted(self, model: str, best_effort: bool) -> None:
        self._admitted.labels(model).inc()

    def dropped(self, model: str, outcome: str) -> None:
        self._dropped.labels(model, outcome).inc()

    def failed(self, model: str, reason: str) -> None:
        self._failed.labels(model, reason).inc()

    def abandoned(self, model: str) -> None:
        self._abandoned.labels(model).inc()

    def observe_ttft(self, model: str, ttft_s: float, slo_s: float) -> None:
        self._ttft.labels(model).observe(ttft_s)
        self._measured.labels(model).inc()
        met, measured = self.slo_counts.get(model, (0, 0))
        within = ttft_s <= slo_s
        if within:
            self._slo_met.labels(model).inc()
        self.slo_counts[model] = (met + int(within), measured + 1)

    def observe_sleep(self, model: str, seconds: float) -> None:
        self._sleep.labels(model).observe(seconds)

    def observe_wake(self, model: str, seconds: float) -> None:
        self._wake.labels(model).observe(seconds)

    def evicted(self, model: str) -> None:
        """An elastic model was put to sleep to make room for another one's wake."""
        self._evictions.labels(model).inc()

    def observe_tpot(self, model: str, tpot_s: float) -> None:
        self._tpot.labels(model).observe(tpot_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

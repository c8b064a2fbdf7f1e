"""examples/grafana/fineslab.json, the dashboard over the router's /metrics (#39): every metric
a panel queries is one the router exports, with the suffix its type gives it (`_total` on a
counter, `_bucket`/`_sum`/`_count` on a histogram), and the panels cover what an operator asks
of a fleet. The exposition is the router's own code (`RouterMetrics` with its scrape-time
collector), with one model, runtime and stream state in it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fineslab.router.metrics import LiveCollector, RouterMetrics
from fineslab.slabs.streamctl import StreamState

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "fineslab.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def _exported() -> dict[str, str]:
    """Metric family name -> type, as the router's /metrics gives them."""
    metrics = RouterMetrics()
    live = SimpleNamespace(
        queue_lengths=lambda: {"m": 0}, replica_states=lambda: [("m", "m-r0", True, 0)],
        model_states=lambda: {"m": "awake"},
        stream_states=lambda: {("m", "m-r0"): StreamState(layers=[1])})
    metrics.register_live(LiveCollector(live, metrics, lambda: {}))  # type: ignore[arg-type]
    metrics.init_model("m")
    text = metrics.exposition().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def unknown_metrics(exprs: list[str], exported: dict[str, str]) -> list[str]:
    """The metric names in `exprs` the router does not export (as queried)."""
    unknown = []
    for name in sorted({n for e in exprs for n in re.findall(r"\bfineslab_[a-z_]+", e)}):
        if exported.get(name) in ("gauge", "unknown"):
            continue
        if not any(name.endswith(s) and exported.get(name.removesuffix(s)) == kind
                   for kind, suffixes in SUFFIXES.items() for s in suffixes):
            unknown.append(name)
    return unknown


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exprs = _exprs()
    assert len(exprs) >= 20
    assert unknown_metrics(exprs, _exported()) == []


@pytest.mark.parametrize("expr", ["fineslab_no_such_metric",
                                  "rate(fineslab_queue_length_total[1m])",
                                  "fineslab_ttft_seconds_total", "fineslab_requests_admitted"])
def test_the_check_catches_a_name_or_suffix_the_router_does_not_export(expr: str) -> None:
    assert unknown_metrics([expr], _exported()) != []


def test_the_panels_cover_state_slo_latency_queues_the_arena_and_wakes() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for what in ("state", "attainment", "goodput", "ttft p50 and p99", "tpot p50 and p99",
                 "queue", "arena slabs by owner and kind", "wakes, sleeps and evictions"):
        assert what in titles, what
    arena = " ".join(_exprs())
    for kind in ('owner!~".+:w"', 'owner=~".+:w"', "fineslab_slab_owner_lent_slabs"):
        assert kind in arena, f"KV, weights and lent slabs apart: {kind}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))

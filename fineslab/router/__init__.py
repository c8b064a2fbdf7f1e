"""The per-node router: OpenAI-compatible API, per-model queues, local scheduler, metrics.

    routes = [ModelRoute(name, (ReplicaRoute(runtime_id, base_url),), ttft_slo_s, predictor,
                         tokenizer_dir, context_tokens, max_running_requests)]
    router = Router(routes, RouterSettings(api_key=None, on_drop="reject"), slabs=snapshots_fn)
    server = RouterServer(router, host="127.0.0.1", port=8000); server.start(); ...; server.stop()
    router.mark_down(runtime_id, reason, back_in_s) / router.mark_up(runtime_id, pid)  # supervisor

Modules: config (routes, settings), requests (validation, prompt tokens), queues (per-model
queue driven by the batch policy: Algorithm 2 by default), replicas (live runtime state),
proxy (forwarding, streaming, TTFT/TPOT), metrics (Prometheus), app (FastAPI), server (uvicorn
in a thread). See docs/serving.md.
"""

from __future__ import annotations

from fineslab.router.app import Router
from fineslab.router.http import create_app
from fineslab.router.queues import RequestDropped
from fineslab.router.routes import ModelRoute, ReplicaRoute, RouterSettings, TokenBudget
from fineslab.router.server import RouterServer

__all__ = [
    "ModelRoute", "ReplicaRoute", "RequestDropped", "Router", "RouterServer", "RouterSettings",
    "TokenBudget", "create_app",
]

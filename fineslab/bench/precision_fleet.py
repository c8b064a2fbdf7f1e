"""The precisions in one arena, through the launcher: the harness of the precision tests and
`fineslab.bench.precisions`.

`run_fleet(runtimes, work_dir, fleet_id, arena_bytes=...)` takes runtimes prepared by
`fineslab.quant.serving.prepare_runtime` (one per named precision), writes the launcher fleet
config that serves each source in its precision, starts it with the launcher's `Fleet` (which
finds the prepared checkpoints by their stamps and reuses them) and yields a `RunningFleet`:
each member's server URL and its block format in the arena. It lives in the launcher, not in
`fineslab.quant`, so that the quantization package never imports the launcher back.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.machine import Fleet
from fineslab.fleet.plan import gpu_kind, make_plan
from fineslab.precisions import NAMED_PRECISIONS
from fineslab.quant.serving import PrecisionRuntime
from fineslab.runtime import free_port
from fineslab.slabs import BlockFormat, SlabArena


@dataclass
class FleetMember:
    """A started runtime of the fleet, its server URL and its block format in the arena."""

    runtime: PrecisionRuntime
    runtime_id: str
    base_url: str
    fmt: BlockFormat

    def generate(self, payload: Mapping[str, object], timeout_s: float = 600.0) -> Any:
        """POST `payload` to the runtime's `/generate` and return the decoded JSON."""
        request = urllib.request.Request(self.base_url + "/generate",
                                         json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())


@dataclass
class RunningFleet:
    arena: SlabArena
    members: dict[str, FleetMember]  # by named precision
    router_url: str


def _fleet_dict(runtimes: list[PrecisionRuntime], fleet_id: str, arena_bytes: int, cpu: bool,
                extra_args: tuple[str, ...], extra_env: Mapping[str, str],
                max_running_requests: int) -> dict[str, Any]:
    """A launcher fleet config serving each prepared runtime's source in its precision."""
    device: dict[str, Any] = {"name": "cpu", "kind": "cpu", "memory_gib": 8}
    if not cpu:
        import torch

        props = torch.cuda.get_device_properties(0)
        device = {"name": "cuda:0", "kind": gpu_kind(props.name),
                  "memory_gib": props.total_memory / (1 << 30)}
    models = []
    for r in runtimes:
        if r.source_dir is None or r.precision not in NAMED_PRECISIONS:
            raise ConfigError(f"{r.name}: run_fleet takes runtimes from prepare_runtime")
        named = NAMED_PRECISIONS[r.precision]
        models.append({"name": r.name, "path": str(r.source_dir),
                       "precision": named.weights.name, "kv_dtype": named.kv.config_name,
                       "ttft_slo_s": 60.0, "request_rate_per_s": 0.1,
                       "extra_args": list(extra_args), "env": dict(extra_env)})
    return {"fleet_id": fleet_id, "devices": [dict(device, kv_arena_mib=arena_bytes / (1 << 20))],
            "kv_pool": "arena", "router": {"port": 0,
                                           "max_running_requests": max_running_requests},
            "models": models}


@contextmanager
def run_fleet(runtimes: list[PrecisionRuntime], work_dir: Path, fleet_id: str, *,
              arena_bytes: int, page_size_tokens: int = 16, cpu: bool = True,
              extra_args: tuple[str, ...] = (), extra_env: Mapping[str, str] | None = None,
              max_running_requests: int = 8) -> Iterator[RunningFleet]:
    """Start `runtimes` (from `prepare_runtime`) in one arena with the launcher's `Fleet`, yield
    when all are healthy, stop everything (runtimes, router, arena) on exit.

    The launcher finds the checkpoints `prepare_runtime` wrote under `work_dir` by their stamps
    and reuses them. On a GPU the launcher needs a profile of the model for that GPU kind
    (`python -m fineslab.profile`), as any GPU fleet does.
    """
    data = _fleet_dict(runtimes, fleet_id, arena_bytes, cpu, extra_args, extra_env or {},
                       max_running_requests)
    plan = make_plan(fleet_from_dict(data, f"<run_fleet {fleet_id}>"), prepared_dir=work_dir,
                     page_sizes=(page_size_tokens,))
    with Fleet(plan, port=free_port(), log_dir=str(work_dir / "logs")) as fleet:
        by_name = {r.name: r for r in runtimes}
        members = {}
        for r in plan.runtimes:
            runtime = dataclasses.replace(fleet.prepared[r.model.name],
                                          precision=by_name[r.model.name].precision)
            members[runtime.precision] = FleetMember(
                runtime, r.runtime_id, fleet.runtime_url(r.runtime_id),
                plan.arenas[0].slab_plan.format_of(r.runtime_id))
        yield RunningFleet(fleet.arenas[plan.arenas[0].device.name], members, fleet.base_url)

"""The one-model fleet that the HTTP profile and the fidelity check measure.

`serve_one_model(model_dir, ...)` starts the full stack the way a user does: the launcher
(`python -m fineslab.launch`, through `fineslab.fleet.FleetHandle`), one runtime of
the model with the SGLang plugin in a CPU slab arena (`kv_pool: arena`), and the router in
front with the FCFS batch policy (the simulator's `SGLANG_FCFS` system). Clients talk to the
router. Both tools start the same fleet, so a profile stored by `fineslab.profile measure
--via http` carries the same HTTP, router, tokenizer and engine overheads that the fidelity
workload meets.

    runtime flags    --chunked-prefill-size <chunk_tokens> (the profile's), --disable-radix-cache
                     (probes repeat prompt lengths; a radix hit would make a prefill free)
    KV pool          kv_arena_mib = kv_pool_tokens * kv_token_bytes / MiB (32,768 tokens of
                     llama-tiny's 2,048 B: 64 MiB)
    cleanup          leaving the context (normally or by an exception) sends the launcher
                     SIGINT and waits for its stop (runtimes, router, arena files); it also
                     holds `--stop-with-fd` on this process's lifeline, so the fleet goes when
                     this process does, even by SIGKILL, or SIGTERM without `exit_on_sigterm`

Cost: starting the fleet takes about 20-40 s on 2 idle cores (model load, warm-up, router).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fineslab.fleet import FleetHandle, FleetStartError

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True)
class FleetSpec:
    """The fleet to start: one model folder, its served name, its KV dtype and pool size."""

    model_dir: Path
    served_name: str
    precision: str
    kv_dtype: str
    chunk_tokens: int
    kv_pool_tokens: int
    kv_token_bytes: int
    ttft_slo_s: float = 5.0
    request_rate_per_s: float = 0.25

    def config(self, fleet_id: str) -> dict[str, Any]:
        """The launcher's YAML config (fineslab/fleet/config.py) as a dict."""
        arena_mib = self.kv_pool_tokens * self.kv_token_bytes / MIB
        return {
            "fleet_id": fleet_id,
            "devices": [{"name": "cpu", "kind": "cpu", "memory_gib": 4,
                         "kv_arena_mib": arena_mib}],
            "kv_pool": "arena", "placement": "mme", "batch_policy": "fcfs",
            "router": {"host": "127.0.0.1", "max_running_requests": 32},
            "models": [{
                "name": self.served_name, "path": str(self.model_dir),
                "precision": self.precision, "kv_dtype": self.kv_dtype, "replicas": 1,
                "ttft_slo_s": self.ttft_slo_s, "request_rate_per_s": self.request_rate_per_s,
                "extra_args": ["--chunked-prefill-size", str(self.chunk_tokens),
                               "--disable-radix-cache"]}],
        }


FLEET_DESCRIPTION = ("python -m fineslab.launch: one runtime in a CPU kv_pool arena, "
                     "router with batch_policy fcfs, --chunked-prefill-size {chunk} "
                     "--disable-radix-cache")


@contextlib.contextmanager
def serve_one_model(spec: FleetSpec) -> Iterator[str]:
    """Start the fleet of `spec`, yield the router's base URL, stop the fleet. The folder of
    its config and logs is removed afterwards, unless the fleet failed to start."""
    folder = Path(tempfile.mkdtemp(prefix="fineslab-fleet-"))
    fleet_id = f"measure-{os.getpid()}"
    logger.info("starting fleet %s (logs in %s)", fleet_id, folder)
    try:
        fleet = FleetHandle.launch(spec.config(fleet_id), folder, "fleet")
    except FleetStartError:
        logger.error("fleet %s did not start; its logs are in %s", fleet_id, folder)
        raise
    except BaseException:  # interrupted while starting: the lifeline stops the launcher
        shutil.rmtree(folder, ignore_errors=True)
        raise
    try:
        yield fleet.base_url
    finally:
        try:  # SIGINT: the launcher stops runtimes and router and removes the arena files
            files = fleet.sglang_files()
            fleet.stop()
            left = fleet.leftovers(files, wait_s=10.0)
            if left:
                logger.warning("fleet %s left %s after its stop", fleet_id, left)
        finally:
            fleet.cleanup()  # only what the stop left: SIGKILL to the launcher and the rest
            shutil.rmtree(folder, ignore_errors=True)


def exit_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, a CI runner) raise SystemExit in the main thread, so that a
    tool's `finally` blocks stop its fleet and remove its folder; without it the lifeline still
    stops the fleet, but the folder stays."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)

"""A running fleet: arenas, supervised runtimes and the router, started and stopped in order.

    start: router port bound (a taken port fails the launch at once) -> leftovers of a dead
           launcher of this fleet_id swept, a live one refused (fineslab.fleet.leftovers) ->
           checkpoints (each model's precision prepared and verified, fineslab.quant.serving) ->
           arenas (one per device, SlabArena.create) -> runtimes (all at once, each joining its
           device's arena through the plugin env) -> wait until healthy -> router -> supervisor
           -> cache reclaimer (idle runtimes flush their prefix caches when a neighbour
           needs the arena: fineslab.fleet.reclaim) -> layer lender and prefix lending
           (each borrower's lent-slab cap: fineslab.fleet.prefix_lending)
    stop:  layer lender, prefix lending, cache reclaimer -> router (no new requests) ->
           runtimes (all at once: process groups, SIGTERM then SIGKILL, SGLang's shm files
           removed) -> arenas (close unlinks
           /dev/shm/fineslab-<fleet>-<device>.{table,arena}) -> the run record

The CLI (`fineslab.launch.__main__`) runs a Fleet until SIGINT or SIGTERM; `Fleet.stop` is safe
to call from any phase of `start` (it stops what exists).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from fineslab.env import WEIGHTS_DIR_VAR
from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.fleet.config import flag_value
from fineslab.fleet.layer_lending import Lender, start_lender, stream_states, write_selectn_requests
from fineslab.fleet.leftovers import RunRecord, sweep
from fineslab.fleet.plan import (
    START_KV_SLABS,
    FleetPlan,
    RuntimePlan,
    runtime_weight_slabs,
)
from fineslab.fleet.prefix_lending import BorrowerSpec, PrefixLending, start_prefix_lending
from fineslab.fleet.reclaim import CacheReclaimer
from fineslab.fleet.runtimes import THREADS_VAR, cpu_threads_env, server_spec, token_budget
from fineslab.fleet.supervisor import SupervisedRuntime, Supervisor
from fineslab.quant.serving import PrecisionRuntime, prepare_served_model, verify_runtime
from fineslab.router import ModelRoute, ReplicaRoute, Router, RouterServer, RouterSettings
from fineslab.router.elastic import CONTROL_TIMEOUT_S, SLEEP_CALLS, ArenaView, Elastic, ElasticSpec
from fineslab.router.routes import KVLimits, TokenBudget
from fineslab.router.server import bind_router_socket
from fineslab.runtime import ServerSpec, prestart_zygote
from fineslab.scheduler.local import TtftPredictor
from fineslab.scheduler.predictors import ChunkedPrefillPredictor
from fineslab.scheduler.refreshed import FollowedPredictor
from fineslab.sglang_plugin.config import EngineSchedule
from fineslab.slabs import ArenaSpec, SlabArena, TableSnapshot, snapshot
from fineslab.slabs.formats import BlockFormat
from fineslab.slabs.integrity import OwnerUsage
from fineslab.slabs.shm import arena_device
from fineslab.slabs.streamctl import StreamState, host_copy_path, request_path, state_path
from fineslab.slabs.table import SlabTable
from fineslab.slabs.weights import free_weight_slabs
from fineslab.zygote import stop_shared_zygotes

logger = logging.getLogger(__name__)

#: Slab-table snapshots are reused for this long (the router asks every dispatch round).
SNAPSHOT_TTL_S = 0.1
#: How long a restart waits for its weights' room (neighbours' caches flushed as they go idle),
#: and how often it looks.
ROOM_WAIT_S = 120.0
ROOM_POLL_S = 1.0


def context_tokens(extra_args: tuple[str, ...], hf_config: dict[str, Any]) -> int:
    """The context the runtimes enforce: `--context-length` in the model's `extra_args`, else
    the model's own (the router refused by the model's 4,096 what a runtime started with
    `--context-length 512` then refused in SGLang's words)."""
    given = flag_value(extra_args, "--context-length")
    if given is not None and given.isdigit() and int(given) > 0:
        return int(given)
    return int(hf_config.get("max_position_embeddings", 2048))


def _vocab_size(hf_config: dict[str, object]) -> int | None:
    """The embedding rows of a HF config (a multimodal config nests it in `text_config`)."""
    for source in (hf_config, hf_config.get("text_config")):
        if isinstance(source, dict) and isinstance(source.get("vocab_size"), int):
            return int(source["vocab_size"])
    return None


class Fleet:
    def __init__(self, plan: FleetPlan, port: int | None = None, log_dir: str | None = None,
                 progress: Callable[[str], None] = logger.info) -> None:
        self.plan, self.progress = plan, progress
        config = plan.config
        self.port = config.router.port if port is None else port
        #: A temporary log folder is removed at a clean stop unless a runtime went down.
        self._temp_logs = log_dir is None
        self._ready = False
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"fineslab-{config.fleet_id}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.arenas: dict[str, SlabArena] = {}
        self.prepared: dict[str, PrecisionRuntime] = {}  # by model name
        self.supervisor: Supervisor | None = None
        self.reclaimer: CacheReclaimer | None = None
        self.lender: Lender | None = None
        self.prefix_lending: PrefixLending | None = None
        self.router: Router | None = None
        self.server: RouterServer | None = None
        self.record: RunRecord | None = None
        self._router_socket: socket.socket | None = None
        self._snapshots: tuple[float, dict[str, TableSnapshot]] = (0.0, {})
        self._snapshot_lock = threading.Lock()
        self._stopping = threading.Event()  # set first thing in stop(): restarts stop waiting
        #: Elastic runtimes' host copies of their weights while asleep (removed at stop).
        self.weights_dir: Path | None = None
        #: What every runtime's environment gets alike (the CPU threads share), set at start.
        self._alike_env: dict[str, str] = {}

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        config = self.plan.config
        self._router_socket = bind_router_socket(config.router.host, self.port)
        self.port = self._router_socket.getsockname()[1]
        self.record = sweep(config.fleet_id, progress=self.progress)
        # The zygote imports SGLang while the checkpoints and arenas are prepared: the first
        # runtime then starts warm without waiting for a whole import (fineslab.zygote).
        self._alike_env = cpu_threads_env(self.plan.runtimes, os.environ,
                                          len(os.sched_getaffinity(0)))
        zygote = threading.Thread(target=prestart_zygote, name="zygote-start", daemon=True,
                                  args=(all(r.device.is_cpu for r in self.plan.runtimes),
                                        config.fleet_id, self._alike_env))
        zygote.start()
        self.prepare()
        for arena_plan in self.plan.arenas:
            spec = ArenaSpec.fit(config.fleet_id, arena_device(arena_plan.device.name),
                                 arena_plan.arena_bytes,
                                 arena_plan.slab_plan.slab_bytes,
                                 list(arena_plan.slab_plan.formats))
            self.arenas[arena_plan.device.name] = SlabArena.create(spec)
            self.progress(f"arena {config.fleet_id}/{arena_plan.device.name}: "
                          f"{spec.num_slabs} slabs of {spec.slab_bytes} B")
        threads = self._alike_env.get(THREADS_VAR)
        self.progress(f"starting {len(self.plan.runtimes)} runtimes (logs in {self.log_dir})"
                      + (f"; {threads} compute thread(s) each on CPU ({THREADS_VAR} chooses)"
                         if threads else ""))
        if any(r.weights_in_arena for r in self.plan.runtimes):
            self.weights_dir = Path(tempfile.mkdtemp(prefix=f"fineslab-{config.fleet_id}-weights-"))
            if self.record is not None:
                self.record.note_folder(self.weights_dir)  # swept if this launcher is killed
            write_selectn_requests(self.plan, self.weights_dir)
        runtimes = [SupervisedRuntime(r, self._server_spec(r), self.log_dir / f"{r.runtime_id}.log")
                    for r in self.plan.runtimes]
        self.supervisor = Supervisor(runtimes, on_down=self._runtime_down,
                                     on_up=self._runtime_up, reclaim=self._reclaim,
                                     progress=self.progress, policy=config.supervision,
                                     before_start=self._room_for_restart,
                                     slow_start=self._slow_start, starved=self._starved)
        self.supervisor.start_all([r.runtime_id for r in self.plan.runtimes
                                   if not r.starts_asleep])
        asleep = self._start_asleep([r for r in self.plan.runtimes if r.starts_asleep])
        for r in runtimes:
            self._note_runtime(r.plan.runtime_id)
        # Routes only now: a runtime whose port was taken at start-up runs on a fresh one.
        router = self.router = Router(self._routes(runtimes), self._settings(),
                                      slabs=self.slab_snapshots, elastic=self._elastic(asleep),
                                      kv_limits=self._kv_limits(),
                                      streaming=self._stream_states)
        for r in runtimes:
            router.mark_up(r.plan.runtime_id, self.supervisor.pid_of(r.plan.runtime_id))
        self.server = RouterServer(router, config.router.host, self.port,
                                   sock=self._router_socket)
        self._router_socket = None  # the server owns it now
        self.server.start()
        self.supervisor.watch()
        if self.arenas:
            devices: dict[str, list[str]] = {}
            for planned in self.plan.runtimes:
                devices.setdefault(planned.device.name, []).append(planned.runtime_id)
            self.reclaimer = CacheReclaimer(devices, lambda d: self.slab_snapshots().get(d),
                                            router.demand, self.runtime_url)
            self.reclaimer.start()
            self.lender = self._lender(self.reclaimer, router.demand)
            self.prefix_lending = start_prefix_lending(
                [BorrowerSpec(r.runtime_id, r.device.name, r.model.prefix_lending.cap,
                              r.model.prefix_lending.window_s, r.model.prefix_lending.check_s)
                 for r in self.plan.runtimes if r.model.prefix_lending is not None],
                devices, lambda d: self.arenas[d].table if d in self.arenas else None)
        self.progress(f"router serving {[m.name for m in config.models]} on "
                      f"{self.server.base_url}/v1")
        if self.record is not None:
            self.record.note_router(self.server.base_url)  # where `fineslab ctl` finds it
        self._ready = True

    def _server_spec(self, r: RuntimePlan) -> ServerSpec:
        config = self.plan.config
        schedule = None
        if config.local_scheduler == "engine":
            schedule = EngineSchedule.for_model(
                config.batch_policy, r.model.ttft_slo_s,
                ChunkedPrefillPredictor.from_profile(self.plan.profiles[r.model.name]),
                refresh=config.engine_refresh, publish=(
                    str(self._scales_path(r.runtime_id)) if config.engine_refresh else None))
        spec = server_spec(r, self.prepared[r.model.name], config.fleet_id,
                           config.kv_pool == "arena",
                           max_running_requests=config.router.max_running_requests,
                           schedule=schedule, contract_dir=self.log_dir,
                           planned=self._planned_block(r),
                           files=self._control_files(r, schedule), base_env=self._alike_env)
        if r.weights_in_arena and self.weights_dir is not None:
            spec = dataclasses.replace(spec, env={**spec.env,
                                                  WEIGHTS_DIR_VAR: str(self.weights_dir)})
        return spec

    def _control_files(self, r: RuntimePlan, schedule: EngineSchedule | None
                       ) -> dict[str, str]:
        """The files runtime `r` and the launcher share, by purpose, for its contract: its
        weights' host copy and its stream request and state (weights in the arena), its timed
        prefill steps (the engine policy, refreshed)."""
        files: dict[str, str] = {}
        if r.weights_in_arena and self.weights_dir is not None:
            fleet_id = self.plan.config.fleet_id
            files.update(weights_host_copy=str(host_copy_path(fleet_id, r.runtime_id,
                                                              self.weights_dir)))
            if r.model.layer_streaming is not None:
                files.update(
                    stream_request=str(request_path(fleet_id, r.runtime_id, self.weights_dir)),
                    stream_state=str(state_path(fleet_id, r.runtime_id, self.weights_dir)))
        if schedule is not None and schedule.publish is not None:
            files["step_scales"] = schedule.publish
        return files

    def _planned_block(self, r: RuntimePlan) -> BlockFormat | None:
        """The block the device's slab plan gives runtime `r` (None on SGLang's own pool)."""
        for arena in self.plan.arenas:
            if arena.device.name == r.device.name:
                return arena.slab_plan.format_of(r.runtime_id)
        return None

    def _elastic(self, asleep: dict[str, int]) -> Elastic | None:
        """The elastic models' manager (fineslab.router.elastic), None when there are none;
        `asleep`: the runtimes that started asleep, with their weight slabs."""
        specs = [ElasticSpec(r.model.name, r.runtime_id, r.device.name, r.model.idle_timeout_s,
                             r.model.pinned) for r in self.plan.runtimes if r.model.elastic]
        if not specs:
            return None
        view = ArenaView(self._free_weight_slabs, self._weight_slabs, self._set_asleep)
        return Elastic(specs, view,
                       retry_after_s=max(1, self.plan.config.router.retry_after_s),
                       asleep=asleep)

    def _start_asleep(self, plans: list[RuntimePlan]) -> dict[str, int]:
        """Start the runtimes an over-committed device does not hold awake, in waves that fit
        its free slabs, each put to sleep once healthy; their weight slabs by runtime id."""
        assert self.supervisor is not None
        slabs: dict[str, int] = {}
        waiting = list(plans)
        while waiting:
            self._flush_started_caches()
            wave: list[RuntimePlan] = []
            free = {d: self._free_weight_slabs(d) or 0 for d in self.arenas}
            for r in waiting:
                # its weights and its warmup's KV (a wave's first member goes regardless)
                need = runtime_weight_slabs(r, self.arenas[r.device.name].spec.slab_bytes) \
                    + START_KV_SLABS
                if not wave or need <= free[r.device.name]:
                    wave.append(r)
                    free[r.device.name] -= need
            waiting = [r for r in waiting if r not in wave]
            self.progress(f"starting {[r.runtime_id for r in wave]}, to sleep once loaded "
                          "(the arena does not hold every model awake)")
            self.supervisor.start_all([r.runtime_id for r in wave])
            for r in wave:
                slabs[r.runtime_id] = self._put_to_sleep(r.runtime_id)
        return slabs

    def _flush_started_caches(self) -> list[str]:
        """Empty the prefix caches of the runtimes up so far (all idle: the router is not up
        yet), so that the next wave's warmups find KV. A wave's first member starts even when
        the free slabs do not cover it: an elastic notebook's fleet once had every slab taken,
        its awake neighbours' warmup caches holding the KV slabs, and the asleep model's warmup
        waited for a slab that nothing would free."""
        assert self.supervisor is not None
        flushed = []
        for runtime_id, r in self.supervisor.runtimes.items():
            if r.process is None or r.process.proc.poll() is not None or r.up_since_s is None:
                continue
            try:
                reply = httpx.post(self.runtime_url(runtime_id) + "/flush_cache", timeout=10)
            except httpx.HTTPError as exc:
                logger.warning("could not flush %s's prefix cache: %s", runtime_id, exc)
                continue
            if reply.status_code == 200:
                flushed.append(runtime_id)
        return flushed

    def _put_to_sleep(self, runtime_id: str) -> int:
        """SGLang's safe order (fineslab.router.elastic): pause, then release; the weight slabs
        it gave back."""
        held = self._weight_slabs(runtime_id) or 0
        self._set_asleep(runtime_id, True)
        url = self.runtime_url(runtime_id)
        for path, body in SLEEP_CALLS:
            request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=CONTROL_TIMEOUT_S) as reply:
                    reply.read()
            except (urllib.error.URLError, OSError) as exc:
                raise EnvironmentSetupError(
                    f"runtime {runtime_id} did not go to sleep after its start ({path}: {exc}); "
                    f"log: {self.log_dir / (runtime_id + '.log')}") from exc
        self.progress(f"runtime {runtime_id} asleep: {held} weight slab(s) back to the arena")
        return held

    def _lender(self, reclaimer: CacheReclaimer, demand: Callable[[], Mapping[str, int]]
                ) -> Lender | None:
        if self.weights_dir is None:
            return None
        return start_lender(self.plan, self.weights_dir, lambda d: self.slab_snapshots().get(d),
                            lambda d: reclaimer.pressed.get(d, False), demand,
                            stalled=lambda d: reclaimer.stalled.get(d, False))

    def _stream_states(self) -> dict[str, StreamState]:
        return stream_states(self.plan, self.weights_dir) if self.weights_dir else {}

    def _kv_limits(self) -> KVLimits | None:
        """The slab tables' KV limits for the router's admin API (None without an arena)."""
        if not self.arenas:
            return None

        def table_of(runtime_id: str) -> SlabTable | None:
            arena = self._arena_of(runtime_id)
            return arena.table if arena is not None else None

        def set_limit(runtime_id: str, limit_bytes: int | None) -> None:
            table = table_of(runtime_id)
            if table is not None:
                table.set_kv_limit(runtime_id, limit_bytes)
                logger.info("KV limit of %s: %s", runtime_id,
                            "none" if limit_bytes is None else f"{limit_bytes} B")

        def get_limit(runtime_id: str) -> int | None:
            table = table_of(runtime_id)
            return table.kv_limits().get(runtime_id) if table is not None else None

        def slab_bytes(runtime_id: str) -> int | None:
            table = table_of(runtime_id)
            return table.dims.slab_bytes if table is not None else None

        return KVLimits(set_limit, get_limit, slab_bytes)

    def _arena_of(self, runtime_id: str) -> SlabArena | None:
        """The arena of the device a planned runtime runs on (None: unknown, or no arena)."""
        runtime = next((r for r in self.plan.runtimes if r.runtime_id == runtime_id), None)
        return self.arenas.get(runtime.device.name) if runtime is not None else None

    def _free_weight_slabs(self, device: str) -> int | None:
        """Free slabs that weights can take (not slab 0: `FIRST_WEIGHT_SLAB`)."""
        arena = self.arenas.get(device)
        return free_weight_slabs(arena.table) if arena is not None else None

    def _weight_slabs(self, runtime_id: str) -> int | None:
        """The weight slabs a runtime holds now (its owner `<runtime id>:w` in the table)."""
        arena = self._arena_of(runtime_id)
        if arena is None:
            return None
        owner = next((o for o in snapshot(arena.table).owners
                      if o.runtime_id == f"{runtime_id}:w"), None)
        return owner.num_slabs if owner is not None else None

    def _set_asleep(self, runtime_id: str, asleep: bool) -> None:
        if self.supervisor is not None:
            self.supervisor.set_asleep(runtime_id, asleep)

    def prepare(self) -> None:
        """Each model's checkpoint in its precision (reused when already prepared), verified
        before any runtime loads it: a bad checkpoint stops the launch with the file named."""
        for r in self.plan.runtimes:
            if r.model.name in self.prepared:
                continue
            start_s = time.monotonic()
            prepared = prepare_served_model(
                r.model.name, r.model.precision, r.model.resolved_kv_dtype, Path(r.model_dir),
                self.plan.prepared_dir_of(r), device=r.prepare_device)
            verify_runtime(prepared)
            self.prepared[r.model.name] = prepared
            if prepared.model_path != Path(r.model_dir) or prepared.kv_env:
                self.progress(f"prepared {r.model.name} ({r.serving}) in "
                              f"{time.monotonic() - start_s:.1f} s: {prepared.model_path}")

    def runtime_url(self, runtime_id: str) -> str:
        assert self.supervisor is not None, "the fleet is not started"
        return self.supervisor.runtimes[runtime_id].spec.base_url

    def _settings(self) -> RouterSettings:
        r = self.plan.config.router
        api_key = None
        if r.api_key_env is not None:
            api_key = os.environ.get(r.api_key_env)
            if not api_key:
                raise ConfigError(f"router.api_key_env names {r.api_key_env}, which is not set")
        return RouterSettings(api_key=api_key, on_drop=r.on_drop, drop_status=r.drop_status,
                              retry_after_s=r.retry_after_s,
                              batch_policy=self.plan.config.batch_policy,
                              upstream_timeout_s=r.upstream_timeout_s,
                              max_body_bytes=r.max_body_bytes)

    def _scales_path(self, runtime_id: str) -> Path:
        """Where an engine-scheduled runtime writes its step scales for the router's gate."""
        return self.log_dir / f"{runtime_id}.steps.json"

    def _routes(self, runtimes: list[SupervisedRuntime]) -> list[ModelRoute]:
        routes = []
        config = self.plan.config
        for model in config.models:
            mine = [r for r in runtimes if r.plan.model.name == model.name]
            model_dir = mine[0].plan.model_dir
            hf_config = json.loads((Path(model_dir) / "config.json").read_text())
            profiled = ChunkedPrefillPredictor.from_profile(self.plan.profiles[model.name])
            predictor: TtftPredictor = profiled
            if config.local_scheduler == "engine" and config.engine_refresh:
                # one predictor: the gate scales the profile as the runtimes' engines do
                predictor = FollowedPredictor(profiled, tuple(
                    self._scales_path(r.plan.runtime_id) for r in mine))
            routes.append(ModelRoute(
                model.name, tuple(ReplicaRoute(r.plan.runtime_id, r.spec.base_url) for r in mine),
                model.ttft_slo_s, predictor,
                tokenizer_dir=model_dir,
                context_tokens=context_tokens(model.extra_args, hf_config),
                vocab_size=_vocab_size(hf_config),
                max_running_requests=(model.max_running_requests
                                      or self.plan.config.router.max_running_requests),
                kv_free_tokens=self.kv_free_tokens if self.plan.arenas else None,
                kv_limit_budget=self.kv_limit_budget if self.plan.arenas else None,
                engine_deadlines=self.plan.config.local_scheduler == "engine",
                token_budget=token_budget(mine[0].plan, config.kv_pool == "arena")))
        return routes

    # -- slab table views (router thread) and reclaim (supervisor thread) -----------------------

    def slab_snapshots(self) -> dict[str, TableSnapshot]:
        with self._snapshot_lock:
            taken_s, snaps = self._snapshots
            if time.monotonic() - taken_s > SNAPSHOT_TTL_S:
                snaps = {device: snapshot(arena.table) for device, arena in self.arenas.items()}
                self._snapshots = (time.monotonic(), snaps)
            return snaps

    def _slab_reading(self, runtime_id: str) -> tuple[TableSnapshot, OwnerUsage, int] | None:
        """The runtime's device's table snapshot, its row and its page size; None where there
        is no reading (not registered, SGLang's own pool)."""
        runtime = next(r for r in self.plan.runtimes if r.runtime_id == runtime_id)
        snap = self.slab_snapshots().get(runtime.device.name)
        owner = next((o for o in snap.owners if o.runtime_id == runtime_id), None) \
            if snap else None
        if snap is None or owner is None or owner.key <= 0 or runtime.page_size is None:
            return None
        return snap, owner, runtime.page_size

    def kv_free_tokens(self, runtime_id: str) -> int | None:
        """Tokens the runtime can still get: the free blocks it can take (its slabs', or its key
        pool's) plus the free slabs' worth (a free padding slab left out, as its allocator
        does), within its KV limit."""
        reading = self._slab_reading(runtime_id)
        if reading is None:
            return None
        snap, owner, page_size = reading
        return owner.available_blocks(snap.kv_free_slabs, snap.slab_bytes) * page_size

    def kv_limit_budget(self, runtime_id: str) -> TokenBudget | None:
        """The KV tokens the runtime's limit lets it hold (the padding slab not counted), None
        without a limit or a reading."""
        reading = self._slab_reading(runtime_id)
        if reading is None:
            return None
        snap, owner, page_size = reading
        blocks = owner.limit_blocks(snap.slab_bytes)
        if blocks is None or blocks < 1:
            return None
        return TokenBudget(blocks * page_size, page_size,
                           f"its KV limit of {owner.kv_limit_bytes} B, fineslab ctl limit")

    def _runtime_down(self, runtime_id: str, reason: str, back_in_s: float) -> None:
        if self.router is not None:
            self.router.mark_down(runtime_id, reason, back_in_s)

    def _runtime_up(self, runtime_id: str, pid: int, base_url: str) -> None:
        self._note_runtime(runtime_id)
        if self.router is not None:
            self.router.mark_up(runtime_id, pid, base_url=base_url)

    def _note_runtime(self, runtime_id: str) -> None:
        """Record the runtime's process group and SGLang shm files for a later sweep."""
        supervisor, record = self.supervisor, self.record
        process = supervisor.runtimes[runtime_id].process if supervisor else None
        if record is not None and process is not None:
            record.note_runtime(runtime_id, process.proc.pid, process.shm_files,
                               process.members)

    def _room_for_restart(self, plan: RuntimePlan) -> None:
        """Before a runtime whose weights live in the arena restarts (a supervisor thread):
        flush the prefix caches of the idle runtimes of its device, then, if its weights still
        do not fit, have the router's elastic manager sleep idle models there until they do,
        then wait, bounded, for busy neighbours to go idle (`_wait_for_room`). Without room the
        start would fail, and fail again at every back-off (a streaming fleet's lender,
        restarted after a SIGSTOP, once found 8 free slabs for its 11: a neighbour's cache
        held them)."""
        router, arena = self.router, self.arenas.get(plan.device.name)
        if not plan.weights_in_arena or router is None or arena is None:
            return
        need = runtime_weight_slabs(plan, arena.spec.slab_bytes)
        if (self._free_weight_slabs(plan.device.name) or 0) >= need:
            return
        if self.reclaimer is not None:
            flushed = self.reclaimer.flush_idle(plan.device.name, exclude=plan.runtime_id)
            if flushed:
                self.progress(f"flushed the prefix caches of {', '.join(flushed)} for "
                              f"{plan.runtime_id}'s weights ({need} slabs) before its restart")
            if (self._free_weight_slabs(plan.device.name) or 0) >= need:
                return
        if router.elastic is None or router.loop is None:
            self._wait_for_room(plan, need)
            return
        self.progress(f"making room for {plan.runtime_id}'s weights ({need} slabs) before its "
                      "restart")
        future = asyncio.run_coroutine_threadsafe(
            router.elastic.make_room_for_restart(plan.runtime_id, need), router.loop)
        give_up_s = time.monotonic() + CONTROL_TIMEOUT_S
        while not future.done():
            # In slices: a fleet stopping meanwhile must not wait for it (Ctrl-C stays fast).
            if self._stopping.wait(0.25) or time.monotonic() > give_up_s:
                future.cancel()
                logger.warning("no room made for %s before its restart (%s)", plan.runtime_id,
                               "the fleet stops" if self._stopping.is_set() else "timed out")
                return
        if not future.cancelled() and future.exception() is not None:
            logger.warning("no room made for %s before its restart: %s", plan.runtime_id,
                           future.exception())
        self._wait_for_room(plan, need)

    def _slow_start(self, plan: RuntimePlan, waited_s: float) -> None:
        """A runtime not healthy after `waited_s` (a supervisor thread): say so, and where its
        device's arena is full, empty the idle neighbours' prefix caches, which its warm-up's
        KV may be waiting for (a five-model elastic fleet once waited 9 minutes, silent, with
        0 free slabs: issue #35)."""
        device = plan.device.name
        free = self._free_weight_slabs(device)
        if free is None:
            self.progress(f"runtime {plan.runtime_id} is still starting after {waited_s:.0f} s")
            return
        why = (f"{free} free slabs on {device}, held by {self._slab_holders(device)}"
               if free < START_KV_SLABS else f"{free} free slabs on {device}")
        flushed: list[str] = []
        if free < START_KV_SLABS:
            flushed = (self.reclaimer.flush_idle(device, exclude=plan.runtime_id)
                       if self.reclaimer is not None else self._flush_started_caches())
        self.progress(f"runtime {plan.runtime_id} is still starting after {waited_s:.0f} s "
                      f"({why})" + (f"; flushed the prefix caches of {', '.join(flushed)}"
                                    if flushed else ""))

    def _starved(self, plan: RuntimePlan) -> str | None:
        """Why `plan`'s runtime, silent and idle, waits for memory (a supervisor thread):
        its device's arena has no slab free for its KV; the idle neighbours' caches are
        emptied at once. None when the arena has room (or there is none)."""
        device = plan.device.name
        free = self._free_weight_slabs(device)
        if free is None or free >= START_KV_SLABS:
            return None
        flushed = (self.reclaimer.flush_idle(device, exclude=plan.runtime_id)
                   if self.reclaimer is not None else [])
        return (f"{free} free slabs on {device}, held by {self._slab_holders(device)}"
                + (f"; flushed the prefix caches of {', '.join(flushed)}" if flushed else ""))

    def _wait_for_room(self, plan: RuntimePlan, need: int) -> None:
        """Wait, up to ROOM_WAIT_S, until `plan`'s weights fit its device's free slabs,
        flushing each neighbour's prefix cache as it goes idle (SGLang flushes only an idle
        runtime: a busy neighbour's cache held a streaming lender's 11 slabs, and its restart
        failed three times in a row, an 85 s outage, issue #35). Says what it waits for and
        what it took; starts anyway at the bound (the start then fails in words)."""
        device = plan.device.name
        free = self._free_weight_slabs(device) or 0
        if free >= need:
            return
        self.progress(f"runtime {plan.runtime_id} waits up to {ROOM_WAIT_S:.0f} s for {need} "
                      f"free slabs for its weights: {free} free, the rest held by "
                      f"{self._slab_holders(device)}; idle neighbours' caches are flushed "
                      "as they go idle")
        start_s = time.monotonic()
        took: list[str] = []
        while not self._stopping.wait(ROOM_POLL_S):
            if self.reclaimer is not None:
                took += self.reclaimer.flush_idle(device, exclude=plan.runtime_id)
            free = self._free_weight_slabs(device) or 0
            waited_s = time.monotonic() - start_s
            if free >= need:
                self.progress(f"room for {plan.runtime_id}'s weights after {waited_s:.0f} s"
                              + (f" (flushed the caches of {', '.join(sorted(set(took)))})"
                                 if took else ""))
                return
            if waited_s > ROOM_WAIT_S:
                logger.warning("runtime %s starts without room for its weights after %.0f s: "
                               "%d of %d slabs free, held by %s", plan.runtime_id, waited_s,
                               free, need, self._slab_holders(device))
                return

    def _slab_holders(self, device: str) -> str:
        """The largest holders of a device's slabs, for a message."""
        snap = self.slab_snapshots().get(device)
        if snap is None:
            return "nobody known"
        held = sorted(((o.num_slabs, o.runtime_id) for o in snap.owners
                       if o.alive and o.num_slabs), reverse=True)
        return ", ".join(f"{runtime} ({slabs})" for slabs, runtime in held[:4]) or "nobody"

    def _reclaim(self, device: str) -> list[str]:
        arena = self.arenas.get(device)
        return arena.table.reclaim_dead_owners() if arena is not None else []

    # -- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()
        if self.lender is not None:
            self.lender.stop()
            self.lender = None
        if self.prefix_lending is not None:
            self.prefix_lending.stop()
            self.prefix_lending = None
        if self.reclaimer is not None:
            self.reclaimer.stop()
            self.reclaimer = None
        if self._router_socket is not None:
            self._router_socket.close()
            self._router_socket = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        troubled = False
        if self.supervisor is not None:
            self.supervisor.stop_all()
            troubled = any(r.restarts for r in self.supervisor.runtimes.values())
            self.supervisor = None
        stop_shared_zygotes()  # it would go with this process anyway; now, and logged
        for device, arena in self.arenas.items():
            try:
                arena.close()
            except Exception:
                logger.exception("closing the arena of %s failed", device)
        self.arenas.clear()
        if self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
            self.weights_dir = None
        if self.record is not None:
            self.record.remove()
            self.record = None
        if self._temp_logs and ((self._ready and not troubled) or _empty(self.log_dir)):
            shutil.rmtree(self.log_dir, ignore_errors=True)  # nothing to read in it
        elif self._temp_logs:
            self.progress(f"runtime logs kept in {self.log_dir} "
                          f"({'a runtime went down' if self._ready else 'the start failed'})")
        self.progress("fleet stopped")

    @property
    def base_url(self) -> str:
        assert self.server is not None, "the fleet is not started"
        return self.server.base_url


def _empty(folder: Path) -> bool:
    """Whether `folder` holds nothing (a start that failed before any runtime wrote a log)."""
    try:
        return not any(folder.iterdir())
    except OSError:
        return False

"""The hook bodies: what the plugin changes inside SGLang's KV set-up, per runtime process.

A `PluginSession` holds one runtime's link to the arena; its methods are installed as AROUND
hooks (`contact.HOOK_TARGETS` lists the targets). In a scheduler process the calls come in this
order:

    (launching process) ServerArgs.check_server_args -> refuse what needs no model, before
                                 SGLang starts the scheduler
    TorchMemorySaverAdapter.create -> ArenaMemorySaver: sleep and wake (memory_saver.py)
    ModelRunner.initialize    -> the weights into arena slabs (when asked): on CUDA the arena
                                 attached and a region planned first, then SGLang's load runs
                                 inside it (its memory saver's region("weights"):
                                 `weights_load`, cuda_weights.py); on CPU moved after loading
    _profile_available_bytes  -> join the arena, refuse what cannot work, report its capacity
    _resolve_kv_pool_class    -> SlabKVPool over the arena views (kind "mha")
    _build_token_to_kv_pool_allocator -> SlabAllocator over this runtime's blocks
    _check_full_pool (idle)   -> SGLang's leak check, with the neighbours' memory accounted for
    _get_new_batch_prefill_raw (every step) -> give back the prefix cache a neighbour's cache
                                 squeeze asks for (`cache_squeeze.py`); reopen admission after
                                 a neighbour freed memory;
                                 with an engine schedule, Algorithm 2 over the waiting queue
                                 (`engine_policy.py`)
    update_running_batch (every decode step) -> skip the step while the neighbours starve a lone
                                 request (`starvation.py`), instead of SGLang aborting it
    _record_scheduler_state_for_paused_engine (each turn while paused, asleep) -> wait on the
                                 scheduler's sockets instead of spinning

Processes that never build a pool never call the others: the detokenizer never opens the arena,
and the launching process (the tokenizer's) reads only its slab table's header.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fineslab.env import KV_FORMAT_VAR, PREFIX_LENDING_VAR, FineslabEnv
from fineslab.errors import ConfigError
from fineslab.sglang_plugin.allocator import SlabAllocator, needs_zeroed_pages
from fineslab.sglang_plugin.config import LENT_RADIX_BACKEND, ArenaJoin
from fineslab.sglang_plugin.cuda_weights import (
    RegionLoad,
    attach_cuda_arena,
    move_into_cuda_region,
    plan_region_load,
)
from fineslab.sglang_plugin.engine_policy import EngineBatchPolicy
from fineslab.sglang_plugin.link import ArenaLink, check_arena_before_start, join_arena
from fineslab.sglang_plugin.memory_saver import ArenaMemorySaver, WeightSleeper, pin_for
from fineslab.sglang_plugin.pool import SlabKVPool
from fineslab.sglang_plugin.quant_pools import Fp8SlabKVPool, Kv4SlabKVPool
from fineslab.sglang_plugin.refusals import refuse_unsupported, settings_of
from fineslab.sglang_plugin.starvation import DecodeShortfall, StarvedRequestPolicy
from fineslab.sglang_plugin.streaming import LayerStreamer, start_streaming
from fineslab.sglang_plugin.weights import place_weights
from fineslab.slabs.formats import KVDtype, KVShape
from fineslab.slabs.shm import arena_device
from fineslab.slabs.streamctl import host_copy_path
from fineslab.slabs.weights import WeightRegion

logger = logging.getLogger(__name__)

#: The KV dtypes SGLang may store in the arena through the plain slab pool.
SGLANG_KV_DTYPES = (KVDtype.BF16, KVDtype.FP16, KVDtype.FP8_E4M3)
#: A scheduler turn that admitted nothing while requests wait for memory and none runs sleeps
#: this long (s) before SGLang's next turn (`PluginSession.new_batch_prefill`).
STARVED_BACKOFF_S = 0.005


def kv_shape_of(configurator: Any, runtime_id: str) -> KVShape:
    """This rank's KV geometry, from SGLang's KV cache configurator (heads already per rank)."""
    dtype = str(configurator.kv_cache_dtype)
    try:
        kv_dtype: KVDtype | None = KVDtype.from_name(dtype)
    except ConfigError:
        kv_dtype = None
    if kv_dtype is None or kv_dtype not in SGLANG_KV_DTYPES:
        raise ConfigError(
            f"unknown model format: KV dtype {dtype} has no slab block format (supported: "
            "bfloat16, float16, fp8_e4m3); set --dtype / --kv-cache-dtype accordingly")
    model_config = configurator.model_config
    if model_config.v_head_dim != model_config.head_dim:
        raise ConfigError("unknown model format: K and V head dims differ")
    return KVShape(
        name=runtime_id,
        num_layers=configurator.layer_info.num_effective_layers,
        num_kv_heads=model_config.get_num_kv_heads(1),
        head_dim=model_config.head_dim,
        kv_dtype=kv_dtype,
    )


def refuse_model_kinds(configurator: Any) -> None:
    """Models whose KV is not one plain MHA pool (MLA, sliding window, Mamba hybrids)."""
    kinds = {
        "MLA attention": configurator.use_mla_backend,
        "hybrid sliding-window attention": configurator.is_hybrid_swa,
        "hybrid Mamba/linear attention": configurator.mambaish_config is not None,
        "a speculative draft worker": configurator.is_draft_worker,
    }
    found = [name for name, on in kinds.items() if on]
    if found:
        raise ConfigError(
            f"unknown model format: the slab KV pool serves plain MHA models, not {found}")


def refuse_settings(join: ArenaJoin, server_args: Any) -> None:
    """The server settings a runtime in an arena cannot run with (`refusals.py`), and the lent
    tier asked for on another radix cache: ConfigError naming them. Needs no model, so the
    launching process checks it too (`PluginSession.check_server_args`)."""
    refuse_unsupported(settings_of(server_args))
    if join.prefix_lending is not None and \
            (backend := server_args.radix_cache_backend) != LENT_RADIX_BACKEND:
        raise ConfigError(
            f"{PREFIX_LENDING_VAR} asks for the lent tier, but SGLang runs radix-cache "
            f"backend {backend!r}: start it with --radix-cache-backend {LENT_RADIX_BACKEND}")


class PluginSession:
    """One runtime's membership of an arena, and the hooks that put it to use."""

    def __init__(self, join: ArenaJoin,
                 opener: Callable[..., ArenaLink] = join_arena,
                 starvation: StarvedRequestPolicy | None = None,
                 engine: EngineBatchPolicy | None = None,
                 attach_weights_arena: Callable[[ArenaJoin, str], Any] = attach_cuda_arena,
                 plan_load: Callable[[ArenaJoin, Any, Path], RegionLoad] = plan_region_load
                 ) -> None:
        self.join = join
        #: Algorithm 2 over SGLang's waiting queue (`engine_policy.py`), when asked for.
        self.engine = engine
        self._opener = opener
        self._attach_weights_arena, self._plan_load = attach_weights_arena, plan_load
        #: CUDA: the arena attached for the weights (the KV join reuses it), and the load
        #: planned into its region until SGLang's load has run in it.
        self.weights_arena: Any = None
        self.region_load: RegionLoad | None = None
        #: How often SGLang entered its memory saver's weights region (its loader call).
        self.weight_loads = 0
        self.starvation = starvation or StarvedRequestPolicy()
        self.link: ArenaLink | None = None
        self.weights: WeightRegion | None = None
        self.sleeper: WeightSleeper | None = None
        self.streamer: LayerStreamer | None = None
        self._memory_saver: ArenaMemorySaver | None = None

    def memory_saver(self, original: Callable[..., Any], *args: Any, **kwargs: Any
                     ) -> ArenaMemorySaver:
        """SGLang's memory-saver factory: one `ArenaMemorySaver` per process, whatever
        `enable_memory_saver` says (sleep and wake act on the arena; memory_saver.py)."""
        if self._memory_saver is None:
            self._memory_saver = ArenaMemorySaver(self)
        return self._memory_saver

    def check_server_args(self, original: Callable[..., Any], server_args: Any,
                          *args: Any, **kwargs: Any) -> Any:
        """In the launching process, before SGLang starts the scheduler and the detokenizer:
        SGLang's own checks, then the plugin's that need no model (`refuse_settings`, the
        arena's presence and room). A bad configuration then stops the runtime once its
        launching process has imported SGLang, not after two more processes imported it and
        the scheduler loaded the model (about 25 s of a 2-core machine for a tiny model); the
        scheduler checks again, and alone checks what needs the model (its KV format, room for
        its weights).

        The join is the one in the environment now, which the scheduler inherits, not this
        session's: a program may start several in-process engines, each with its own join,
        and SGLang loads plugins (this session) once per process."""
        result = original(server_args, *args, **kwargs)
        join = ArenaJoin.from_env()
        if join is not None:
            try:
                refuse_settings(join, server_args)
                check_arena_before_start(join, arena_device(str(server_args.device),
                                                            server_args.base_gpu_id))
            except ConfigError as exc:
                logger.critical("fineslab plugin: refused before SGLang started the scheduler: "
                                "%s", exc)
                raise
        return result

    def initialize_model(self, original: Callable[..., Any], runner: Any,
                         *args: Any, **kwargs: Any) -> Any:
        """SGLang's model set-up with (when `weights_in_arena`) the weights in the arena: on
        CUDA loaded inside a region planned here (unless layers stream: moved into a
        layer-aligned one after), on CPU moved after loading; then the streamer and the
        sleeper (its host copy pinned on CUDA)."""
        if not self.join.weights_in_arena or self.weights is not None:
            return original(runner, *args, **kwargs)
        device = arena_device(str(runner.device), runner.gpu_id)
        if device.startswith("cuda"):
            self.weights_arena = self._attach_weights_arena(self.join, device)
            if not self.join.layer_streaming:
                self.region_load = self._plan_load(self.join, self.weights_arena,
                                                   Path(runner.model_config.model_path))
        result = original(runner, *args, **kwargs)
        if self.region_load is not None:
            moved = self.region_load.finish(runner.model)
            self.weights = self.region_load.region
        elif self.weights_arena is not None:
            self.weights, moved = move_into_cuda_region(self.join, self.weights_arena,
                                                        runner.model)
        else:
            self.weights, moved = place_weights(self.join, runner.model, device)
        spans = moved.layers
        host_copy = host_copy_path(self.join.arena_name, self.join.runtime_id)
        if self.join.layer_streaming:
            self.streamer = start_streaming(self.join, self.weights, spans, runner.model,
                                            host_copy)
        streamer_pinned = None if self.streamer is None else self.streamer.pinned
        self.sleeper = WeightSleeper(self.weights, host_copy,
                                     host_copy_written=self.streamer is not None,
                                     pin=pin_for(self.weights), pinned=streamer_pinned)
        return result

    @contextlib.contextmanager
    def weights_load(self) -> Iterator[None]:
        """Around SGLang's loader call (its memory saver's region("weights")): inside the
        planned arena region on CUDA, as is on CPU (moved after)."""
        self.weight_loads += 1
        load = self.region_load if self.weights is None else None
        logger.info("fineslab: SGLang's weight load of %r runs inside the memory saver's "
                    "weights region (%s)", self.join.runtime_id,
                    "into its arena region" if load is not None else "moved after, if asked")
        if load is None:
            yield
            return
        with load.around_load():
            yield

    def _require_link(self) -> ArenaLink:
        if self.link is None:
            raise ConfigError(
                "fineslab plugin: SGLang built a KV pool before sizing it; this SGLang version "
                "calls the configurator in an order the plugin does not know")
        return self.link

    def _stored_shape(self, model_shape: KVShape) -> KVShape:
        """The KV shape the arena stores: the model's, or in the join's quantized format (KV4,
        FP8 on CPU), which needs SGLang on a 16-bit KV dtype (`--kv-cache-dtype auto`)."""
        if self.join.kv_format is None:
            return model_shape
        if model_shape.kv_dtype not in (KVDtype.BF16, KVDtype.FP16):
            raise ConfigError(f"{KV_FORMAT_VAR} needs SGLang's --kv-cache-dtype auto (bf16 or "
                              f"fp16 model), not {model_shape.kv_dtype.value}")
        return dataclasses.replace(model_shape, kv_dtype=self.join.kv_format)

    def profile_available_bytes(self, original: Callable[..., int], configurator: Any,
                                *args: Any, **kwargs: Any) -> int:
        """Join the arena and report its capacity instead of profiling device memory."""
        refuse_settings(self.join, configurator.server_args)
        refuse_model_kinds(configurator)
        model_shape = kv_shape_of(configurator, self.join.runtime_id)
        shape = self._stored_shape(model_shape)
        if self.link is None:
            device = arena_device(str(configurator.device), configurator.gpu_id)
            self.link = (self._opener(self.join, shape, configurator.page_size, device)
                         if self.weights_arena is None else
                         self._opener(self.join, shape, configurator.page_size, device,
                                      arena=self.weights_arena))
        link = self.link
        capacity_tokens = link.capacity_tokens
        logger.info(
            "fineslab: runtime %r joined arena %r with %s KV: %d slots of %d B (%d-token "
            "blocks); KV capacity %d tokens", self.join.runtime_id, self.join.arena_name,
            shape.kv_dtype.value, link.num_slots, link.fmt.token_stride_bytes,
            link.fmt.tokens_per_block, capacity_tokens)
        # config_from_budget divides by SGLang's own (model dtype, unpadded) token size, so
        # this budget gives back exactly `capacity_tokens` (or fewer under --max-total-tokens).
        return capacity_tokens * model_shape.token_bytes

    def resolve_kv_pool_class(self, original: Callable[..., type], configurator: Any,
                              *args: Any, kind: str, default: type, **kwargs: Any) -> type:
        if kind != "mha":
            return original(configurator, *args, kind=kind, default=default, **kwargs)
        views = self._require_link().views
        if self.join.kv_format is KVDtype.INT4:
            return Kv4SlabKVPool.over(views)
        if self.join.kv_format is KVDtype.FP8_E4M3:
            from fineslab.quant.fp8 import kv_scales_or_warn

            return Fp8SlabKVPool.with_scales(
                views, kv_scales_or_warn(self.join.kv_scales_path, len(views)))
        return SlabKVPool.over(views)

    def build_allocator(self, original: Callable[..., Any], configurator: Any,
                        *args: Any, **kwargs: Any) -> SlabAllocator:
        link = self._require_link()
        if kwargs.get("token_to_kv_pool_allocator") is not None:
            raise ConfigError("fineslab plugin: a shared (draft) allocator is not supported")
        pool = kwargs["token_to_kv_pool"]
        if not isinstance(pool, SlabKVPool):
            raise ConfigError(
                f"fineslab plugin: SGLang built a {type(pool).__name__}, not the SlabKVPool; "
                "a server setting picked another pool (e.g. --kv-cache-dtype mxfp8)")
        device = str(configurator.device)
        return SlabAllocator(
            kwargs["sizes"].max_total_num_tokens, configurator.page_size,
            configurator.kv_cache_dtype, device, pool, need_sort=False, source=link.source,
            page_bytes=link.page_bytes() if needs_zeroed_pages(device) else None,
            squeeze=FineslabEnv.from_environ().cache_squeeze)

    def tree_cache(self, ctx: Any) -> Any:
        """The `fineslab_lent` radix-cache backend: SGLang's radix cache over a lent tier in
        this runtime's arena (`prefix_tier.py`), its cap set from the join."""
        from fineslab.sglang_plugin.prefix_tier import LentRadixCache
        from fineslab.slabs.lent import LentPages, set_lend_cap

        if ctx.disable_radix_cache:
            return LentRadixCache(ctx.params, None)
        link = self._require_link()
        table, slot = link.source.table, link.source.slot
        set_lend_cap(table, self.join.runtime_id, self.join.prefix_lending or 0)
        lent = LentPages(table, slot, link.page_bytes(), link.source.blocks_per_slab)
        logger.info("fineslab: runtime %r keeps evicted prefix pages in up to %d lent slab(s)",
                    self.join.runtime_id, self.join.prefix_lending)
        return LentRadixCache(ctx.params, lent)

    def new_batch_prefill(self, original: Callable[..., Any], scheduler: Any, *args: Any,
                          **kwargs: Any) -> Any:
        """Give back the prefix cache a neighbour's cache squeeze asks for (`cache_squeeze.py`),
        reopen SGLang's admission when a neighbour gave memory back (see
        `SlabAllocator.admission_reopens`), then run SGLang's own prefill admission (on what
        the engine policy admitted, when there is one); a turn that admitted nothing while
        requests wait and none runs sleeps STARVED_BACKOFF_S."""
        allocator = scheduler.token_to_kv_pool_allocator
        if isinstance(allocator, SlabAllocator):
            allocator.give_cache_back(scheduler.tree_cache)  # a neighbour's cache squeeze
        running_batch = kwargs.get("running_batch", args[1] if len(args) > 1 else None)
        if isinstance(allocator, SlabAllocator) and running_batch is not None and \
                allocator.admission_reopens(bool(running_batch.batch_is_full)):
            running_batch.batch_is_full = False
        if self.engine is not None:
            result = self.engine.around(original, scheduler, *args, **kwargs)
        else:
            result = original(scheduler, *args, **kwargs)
        formed = result[0] if isinstance(result, tuple) else result  # (new batch, running)
        running = result[1] if isinstance(result, tuple) else running_batch
        if formed is None and isinstance(allocator, SlabAllocator) and scheduler.waiting_queue \
                and (running is None or running.batch_size() == 0):
            # Requests wait, none runs, none was admitted: the memory they wait for is the
            # neighbours' (or a request's own budget). SGLang turns again at once, so a starved
            # runtime spun a core until memory came back (the live capacity grid: three idle
            # fleets' starved schedulers took 55% of a core each, slowing the probed fleet).
            # Memory comes back from other processes, so a short sleep, not a wait on sockets.
            time.sleep(STARVED_BACKOFF_S)
        return result

    def update_running_batch(self, original: Callable[..., Any], scheduler: Any, *args: Any,
                             **kwargs: Any) -> Any:
        """Skip this decode step (return None, as SGLang does while finishing requests free
        memory) while the neighbours starve a lone request; else run SGLang's own update, which
        decodes, retracts or aborts. The allocator's answer is immediate either way; the hold
        and its bound are `self.starvation`'s."""
        allocator = scheduler.token_to_kv_pool_allocator
        batch = kwargs.get("batch", args[0] if args else None)
        if isinstance(allocator, SlabAllocator) and batch is not None:
            num_running = batch.batch_size()
            fits, within_cap = True, True
            if num_running == 1:
                num_tokens = batch.new_tokens_required_next_decode()
                fits = allocator.check_decode_capacity(num_tokens=num_tokens,
                                                       tree_cache=batch.tree_cache)
                within_cap = allocator.cap_allows(num_tokens)
            if self.starvation.hold(DecodeShortfall(num_running, fits, within_cap)):
                return None
        return original(scheduler, *args, **kwargs)

    def paused_engine_turn(self, original: Callable[..., Any], scheduler: Any, *args: Any,
                           **kwargs: Any) -> Any:
        """One turn of a paused scheduler's loop (`/pause_generation`: an asleep model). SGLang
        reads its sockets, records its state and turns again at once, so every asleep runtime
        spun a core (five asleep runtimes of the elastic notebook took 30% of a core each and
        slowed a rehearsal of the suite 3-4x). With SGLang's idle sleeper on (`--sleep-on-idle`,
        set in CPU mode) the turn ends waiting on those same sockets: a request or a control
        call (wake, continue) ends the wait at once, else it ends after 1 s."""
        result = original(scheduler, *args, **kwargs)
        if scheduler.idle_sleeper is not None:
            scheduler.maybe_sleep_on_idle()
        return result

    def check_full_pool(self, original: Callable[..., Any], checker: Any, ps: Any,
                        *args: Any, **kwargs: Any) -> Any:
        """SGLang's leak check sees only this runtime: blocks held by neighbours count as used
        by nobody here, so `available` becomes capacity minus what this runtime holds."""
        allocator = checker.token_to_kv_pool_allocator
        if isinstance(allocator, SlabAllocator):
            own_free = checker.max_total_num_tokens - allocator.used_tokens()
            ps = dataclasses.replace(ps, full_available_size=own_free)
        return original(checker, ps, *args, **kwargs)

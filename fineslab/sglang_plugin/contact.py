"""Every SGLang name the plugin relies on, in one table that start-up checks (`contact_check`).

The plugin subclasses SGLang's KV pool, allocator and prefill budget, wraps SGLang methods
(most of them private; the rows with a `hook`) with AROUND hooks, and reads private attributes
of SGLang objects. None of that
is SGLang's public API: a rename in the next SGLang minor would not fail, it would silently
route around the plugin (a renamed `_release_page_ids` sends freed pages to SGLang's private
free list, which the arena never sees). So every such name is a row here, and `install` refuses
to start unless each row still holds in the installed SGLang.

Glossary
    contact        one SGLang name, by dotted path: `module`, `module.Class`, `module.function`,
                   `module.Class.member`
    kind           MODULE, CLASS, FUNCTION, METHOD (a callable attribute of a class) or
                   ATTRIBUTE (a class or instance attribute)
    parameters     for a callable: the parameter names the plugin passes, receives or mirrors in
                   an override (checked against `inspect.signature`)
    in_source_of   methods of the owner class (searched through its SGLang bases) whose source
                   must mention `self.<member>`. For an instance attribute, where SGLang sets it
                   (the only evidence that exists without an instance); for a method the plugin
                   overrides, the SGLang callers that must still call it for the override to
                   take effect. Empty: the member must be declared on the class (a class
                   attribute, method or property, a dataclass or msgspec field, an annotation)
    hook           for the methods the plugin wraps: the `PluginSession` method installed as an
                   AROUND hook (`HOOK_TARGETS`)

Keeping it complete: `tests/sglang_plugin/test_plugin_contact.py` scans the plugin's source
(imports from sglang, `sglang.` strings, overrides of SGLang methods and `self.` uses of
SGLang members in the subclasses, attributes read from SGLang objects the hooks receive) and
fails naming any SGLang name without a row. A new SGLang object reached through a new variable
name must be added to that test's TYPED_NAMES; the test's docstring says how.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from fineslab.sglang_plugin.refusals import PARALLEL_SIZES, REFUSALS


class Kind(enum.Enum):
    MODULE = "module"
    CLASS = "class"
    FUNCTION = "function"
    METHOD = "method"
    ATTRIBUTE = "attribute"


CALLABLE_KINDS = (Kind.FUNCTION, Kind.METHOD)


@dataclass(frozen=True)
class Contact:
    """One SGLang name the plugin relies on, what of it, and why."""

    path: str
    kind: Kind
    why: str
    parameters: tuple[str, ...] = ()
    in_source_of: tuple[str, ...] = ()
    hook: str | None = None

    def __post_init__(self) -> None:
        if not self.path.startswith("sglang"):
            raise ValueError(f"{self.path}: a contact is an SGLang name")
        if self.parameters and self.kind not in CALLABLE_KINDS:
            raise ValueError(f"{self.path}: only a callable has parameters")
        if self.in_source_of and self.kind not in (Kind.METHOD, Kind.ATTRIBUTE):
            raise ValueError(f"{self.path}: only a class member is looked for in sources")
        if self.hook is not None and self.kind is not Kind.METHOD:
            raise ValueError(f"{self.path}: only a method is hooked")

    @property
    def owner(self) -> str:
        """The dotted path of what holds the name (a class for members)."""
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_POOL_SIZES = "sglang.srt.mem_cache.kv_cache_configurator._PoolSizes"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
_POOL_STATS = "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_MODEL_CONFIG = "sglang.srt.configs.model_config.ModelConfig"
_LAYER_INFO = "sglang.srt.model_executor.model_runner_components.layer_setup.ModelLayerInfo"
_ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_REGISTRY = "sglang.srt.plugins.hook_registry"
_ALLOCATOR = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
_BUDGET = "sglang.srt.mem_cache.prefill_budget.PrefillBudget"
_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"

_METHOD, _ATTRIBUTE = Kind.METHOD, Kind.ATTRIBUTE


def _members(owner: str, kind: Kind, names: Iterable[str], why: str,
             in_source_of: tuple[str, ...] = ()) -> tuple[Contact, ...]:
    """Rows for several members of `owner` that the plugin uses for one reason."""
    return tuple(Contact(f"{owner}.{name}", kind, why, in_source_of=in_source_of)
                 for name in names)


_HOOKS = (
    Contact(f"{_SERVER_ARGS}.check_server_args", _METHOD,
            "in the launching process, before SGLang starts the scheduler: refuses what needs "
            "no model (settings, the lent tier's backend, a missing or too small arena)",
            hook="check_server_args"),
    Contact("sglang.srt.utils.torch_memory_saver_adapter.TorchMemorySaverAdapter.create",
            _METHOD, "returns the ArenaMemorySaver: /release_memory_occupation and "
            "/resume_memory_occupation put the weights to sleep and wake them",
            ("enable",), hook="memory_saver"),
    Contact(f"{_RUNNER}.initialize", _METHOD,
            "after SGLang loaded the model and before it builds the KV pool: moves the weights "
            "into the arena when FINESLAB_WEIGHTS_IN_ARENA=1", hook="initialize_model"),
    Contact(f"{_CONFIGURATOR}._profile_available_bytes", _METHOD,
            "joins the arena and returns its capacity as the KV budget instead of profiling "
            "device memory", ("pre_model_load_memory",), hook="profile_available_bytes"),
    Contact(f"{_CONFIGURATOR}._resolve_kv_pool_class", _METHOD,
            "hands SGLang the SlabKVPool for kind 'mha'", ("kind", "default"),
            hook="resolve_kv_pool_class"),
    Contact(f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", _METHOD,
            "builds the SlabAllocator over this runtime's blocks",
            ("sizes", "token_to_kv_pool", "token_to_kv_pool_allocator"), hook="build_allocator"),
    Contact(f"{_CHECKER}._check_full_pool", _METHOD,
            "SGLang's idle leak check, with the neighbours' memory accounted for",
            ("ps", "uncached"), hook="check_full_pool"),
    Contact(f"{_SCHEDULER}._get_new_batch_prefill_raw", _METHOD,
            "reopens admission (batch_is_full) when a neighbour gave memory back; with an "
            "engine schedule, runs Algorithm 2 over the waiting queue first",
            ("prefill_delayer_single_pass", "running_batch"), hook="new_batch_prefill"),
    Contact(f"{_SCHEDULER}.update_running_batch", _METHOD,
            "skips a decode step (SGLang's own 'None skips decode this step') while a lone "
            "request is starved by the neighbours, instead of letting SGLang abort it",
            ("batch",), hook="update_running_batch"),
    Contact(f"{_SCHEDULER}._record_scheduler_state_for_paused_engine", _METHOD,
            "each turn of a paused (asleep) scheduler's loop: ends it waiting on the "
            "scheduler's sockets instead of spinning a core", hook="paused_engine_turn",
            in_source_of=("event_loop_normal",)),
)

_REGISTRY_CONTACTS = (
    Contact(f"{_REGISTRY}.HookRegistry.register", _METHOD,
            "registers each AROUND hook", ("target", "hook", "hook_type")),
    Contact(f"{_REGISTRY}.HookRegistry.apply_hooks", _METHOD, "patches SGLang with the hooks"),
    Contact(f"{_REGISTRY}.HookRegistry._patched", _ATTRIBUTE,
            "read to prove every hook was applied (SGLang only logs a hook that fails)"),
    Contact(f"{_REGISTRY}.HookType.AROUND", _ATTRIBUTE, "the hook type of every hook"),
)

_RUNNER_STATE = (
    Contact(f"{_RUNNER}.model", _ATTRIBUTE, "the loaded model whose weights move to the arena",
            in_source_of=("load_model",)),
    *_members(_RUNNER, _ATTRIBUTE, ("device", "gpu_id"), "the arena device of the weights",
              in_source_of=("__init__",)),
)

_SCHEDULER_STATE = (
    *_members(_CONFIGURATOR, _ATTRIBUTE, (
        "kv_cache_dtype", "model_config", "layer_info", "use_mla_backend", "is_hybrid_swa",
        "mambaish_config", "is_draft_worker", "server_args", "device", "gpu_id", "page_size"),
        "read by the hooks to derive the block format and refuse what the arena cannot serve"),
    Contact(f"{_LAYER_INFO}.num_effective_layers", _ATTRIBUTE,
            "the number of layers in this runtime's KV format"),
    *_members(_MODEL_CONFIG, _ATTRIBUTE, ("head_dim", "v_head_dim"),
              "the KV head size of the block format", in_source_of=("_derive_model_shapes",)),
    Contact(f"{_MODEL_CONFIG}.get_num_kv_heads", _METHOD, "KV heads of the block format",
            ("tensor_parallel_size",)),
    Contact(f"{_POOL_SIZES}.max_total_num_tokens", _ATTRIBUTE,
            "SGLang's capacity, the SlabAllocator's size"),
    *_members(_CHECKER, _ATTRIBUTE, ("token_to_kv_pool_allocator", "max_total_num_tokens"),
              "the leak-check hook recomputes this runtime's own free tokens"),
    Contact(f"{_POOL_STATS}.full_available_size", _ATTRIBUTE,
            "replaced (dataclasses.replace) by the leak-check hook"),
    Contact(f"{_SCHEDULER}.token_to_kv_pool_allocator", _ATTRIBUTE,
            "the scheduler hooks find the SlabAllocator here", in_source_of=("__init__",)),
    *_members(_BATCH, _ATTRIBUTE, ("batch_is_full", "tree_cache"),
              "the scheduler hooks reopen admission and evict for the starved-request check"),
    Contact(f"{_BATCH}.batch_size", _METHOD, "how many requests decode (starved-request check)"),
    Contact(f"{_BATCH}.new_tokens_required_next_decode", _METHOD,
            "the next decode step's token demand (starved-request check)", ("selected_indices",)),
    Contact(f"{_ATTENTION}.layer_id", _ATTRIBUTE, "the quantized pools' layer index",
            in_source_of=("__init__",)),
    *_members(_SERVER_ARGS, _ATTRIBUTE,
              [r.setting for r in REFUSALS] + [name for name, _ in PARALLEL_SIZES],
              "read by the start-up refusals: a renamed setting would never be refused"),
    *_members(_SERVER_ARGS, _ATTRIBUTE, ("device", "base_gpu_id"),
              "the arena device the launching process checks before SGLang starts the "
              "scheduler"),
)

_ALLOCATOR_CONTACTS = (
    Contact(_ALLOCATOR, Kind.CLASS, "SlabAllocator's base"),
    Contact(f"{_ALLOCATOR}.__init__", _METHOD, "SlabAllocator keeps SGLang's constructor",
            ("size", "page_size", "dtype", "device", "kvcache", "need_sort")),
    Contact(f"{_ALLOCATOR}.clear", _METHOD,
            "overridden to return every held page; the base constructor must call it",
            in_source_of=("__init__",)),
    Contact(f"{_ALLOCATOR}._release_page_ids", _METHOD,
            "overridden to send freed pages back to the arena: every free path must end here, "
            "or freed pages go to SGLang's private free list", ("page_ids",),
            in_source_of=("free", "free_page_ids", "free_group_end")),
    Contact(f"{_ALLOCATOR}.free_pages", _ATTRIBUTE,
            "swapped for exactly the taken pages around SGLang's slot-picking kernels",
            in_source_of=("clear", "alloc_extend", "alloc_decode")),
    *_members(_ALLOCATOR, _ATTRIBUTE,
              ("free_group", "free_page_ids_group", "staged_pages", "num_staged_pages"),
              "SGLang's free-list state, set empty by the overriding clear as the base does",
              in_source_of=("clear",)),
    *_members(_ALLOCATOR, _ATTRIBUTE, ("use_triton_kernels", "device", "page_size"),
              "read (use_triton_kernels also narrowed to power-of-two pages)",
              in_source_of=("__init__",)),
    Contact(f"{_ALLOCATOR}.alloc", _METHOD, "overridden: pages from the arena", ("need_size",)),
    Contact(f"{_ALLOCATOR}.alloc_extend", _METHOD,
            "overridden: SGLang's kernel over exactly the taken pages",
            ("prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc",
             "extend_num_tokens", "num_new_pages")),
    Contact(f"{_ALLOCATOR}.alloc_decode", _METHOD,
            "overridden: SGLang's kernel over exactly the taken pages",
            ("seq_lens", "seq_lens_cpu", "last_loc")),
    Contact(f"{_ALLOCATOR}.check_decode_capacity", _METHOD,
            "overridden: reserves the decode step's pages",
            ("num_tokens", "tree_cache", "requests", "spec_algorithm")),
    Contact(f"{_ALLOCATOR}.create_prefill_budget", _METHOD,
            "overridden: a budget that reserves as it admits",
            ("tree_cache", "num_mixed_decode_tokens")),
    Contact(f"{_ALLOCATOR}.evict_to_free_tokens", _METHOD,
            "called before reserving decode pages", ("tree_cache", "num_tokens")),
    *_members(_ALLOCATOR, _METHOD, (
        "available_size", "merge_and_sort_free", "get_all_free_pages", "verify_byte_accounting"),
        "overridden: no private free list; available memory and integrity come from the arena"),
    Contact("sglang.srt.utils.get_num_new_pages", Kind.FUNCTION,
            "pages an extend or decode step takes", ("seq_lens", "page_size", "prefix_lens",
                                                     "decode")),
    Contact(_BUDGET, Kind.CLASS, "SlabPrefillBudget's base"),
    Contact(f"{_BUDGET}.__init__", _METHOD, "SlabAllocator builds its budget with it",
            ("allocator", "tree_cache", "num_mixed_decode_tokens")),
    Contact(f"{_BUDGET}.can_allocate_prefill", _METHOD,
            "overridden: reserves the admitted prefill's pages",
            ("paged_input", "extend_input_len", "max_new_tokens", "chunk_limit")),
    Contact(f"{_BUDGET}.check_prefill", _METHOD,
            "overridden: every admission holds its prefill's pages",
            ("extend_input_len", "total_tokens", "max_new_tokens", "input_tokens",
             "swa_host_hit_length", "chunk_limit", "auxiliary_swa_host_hit_length")),
    Contact(f"{_BUDGET}.available_chunk_tokens", _METHOD,
            "overridden: a chunk goes ahead with its pages held, or waits a step",
            ("chunk_limit",)),
    Contact(f"{_BUDGET}.remaining_total", _ATTRIBUTE,
            "what SGLang's own chunk size starts from"),
    Contact(f"{_BUDGET}.ceil_paged_tokens", _METHOD, "pages of a prefill", ("tokens",)),
    Contact(f"{_SCHEDULER}.idle_sleeper", _ATTRIBUTE,
            "SGLang's socket poller (None without --sleep-on-idle), for a paused scheduler",
            in_source_of=("init_idle_sleeper",)),
    Contact(f"{_SCHEDULER}.maybe_sleep_on_idle", _METHOD,
            "waits up to 1 s on the scheduler's sockets, woken at once by a request"),
    *_members("sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache", _METHOD,
              ("full_evictable_size", "supports_mamba", "supports_prefix_sharing"),
              "what a held admission leaves to the prefix cache (SlabPrefillBudget._hold), "
              "and an allocation's last resort (SlabAllocator._evict_for)"),
    *_members(_BUDGET, _ATTRIBUTE, ("allocator", "current_offset", "page_size", "tree_cache"),
              "the tokens admitted so far in this step", in_source_of=("__init__",)),
    Contact(f"{_BUDGET}.total_offset", _ATTRIBUTE,
            "the tokens (with their new tokens) admitted so far: what a refused admission "
            "asks the neighbours for (the cache squeeze)", in_source_of=("__init__",)),
)

_POOL_CONTACTS = (
    Contact(_POOL, Kind.CLASS, "SlabKVPool's base"),
    Contact(f"{_POOL}.__init__", _METHOD, "SGLang builds the pool with its own constructor",
            ("size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device",
             "enable_memory_saver")),
    Contact(f"{_POOL}._create_buffers", _METHOD,
            "overridden to point the buffers at the arena; the constructor must call it",
            in_source_of=("__init__",)),
    Contact(f"{_POOL}._init_data_ptrs_and_strides", _METHOD,
            "called after the buffers are set, as SGLang does", in_source_of=("_create_buffers",)),
    *_members(_POOL, _ATTRIBUTE, ("k_buffer", "v_buffer"),
              "set to the arena views instead of SGLang's allocation",
              in_source_of=("_create_buffers_normal",)),
    *_members(_POOL, _ATTRIBUTE, (
        "k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
        "dq_k_buffer", "dq_v_buffer", "_kv_buffer_descs"),
        "set as SGLang's _create_buffers sets them", in_source_of=("_create_buffers",)),
    *_members(_POOL, _ATTRIBUTE, (
        "post_capture_active", "quant_method", "kv_cache_layout",
        "size", "page_size", "layer_num", "head_num", "head_dim", "v_head_dim", "store_dtype",
        "device", "start_layer", "dtype"),
        "read to check the views' geometry and refuse what the arena cannot serve",
        in_source_of=("__init__",)),
    Contact(f"{_POOL}.is_quantized_kv_cache", _ATTRIBUTE,
            "a property: quantized KV methods are refused"),
    Contact(f"{_POOL}._clear_buffers", _METHOD, "overridden: the arena outlives the runtime"),
    Contact(f"{_POOL}.get_contiguous_buf_infos", _METHOD,
            "overridden to refuse (PD / HiCache registration of contiguous buffers)"),
    Contact(f"{_POOL}.get_cpu_copy", _METHOD, "overridden to refuse (CPU KV offload)",
            ("indices", "mamba_indices", "req_pool_index")),
    Contact(f"{_POOL}.load_cpu_copy", _METHOD, "overridden to refuse (CPU KV offload)",
            ("kv_cache_cpu", "indices", "mamba_indices", "req_pool_index")),
    Contact(f"{_POOL}._init_kv_copy_and_warmup", _METHOD,
            "overridden to refuse (speculative decoding's KV copy)"),
    *_members(_POOL, _METHOD, ("get_key_buffer", "get_value_buffer", "_get_key_buffer",
                               "_get_value_buffer"),
              "overridden by the quantized pools to dequantize on read"),
    Contact(f"{_POOL}.set_kv_buffer", _METHOD,
            "overridden by the quantized pools to quantize on write",
            ("layer", "loc_info", "cache_k", "cache_v", "k_scale", "v_scale",
             "layer_id_override", "dcp_kv_mask")),
    Contact("sglang.srt.mem_cache.memory_pool.unwrap_write_loc", Kind.FUNCTION,
            "the quantized pools' write slots", ("loc_info",)),
)

#: Every SGLang name the plugin relies on; `contact_check.check_contacts` checks them all.
_LLAMA = "sglang.srt.models.llama"
#: The layer streamer (streaming.py) finds the decoder layers as `<...>.layers.<i>` and brackets
#: a forward pass with hooks on the module that holds them, which must be called through
#: `__call__` by the causal LM's forward (checked on Llama, the model the streaming tests run).
_STREAMING_CONTACTS = (
    Contact(f"{_LLAMA}.LlamaModel.layers", _ATTRIBUTE,
            "the decoder layers the layer streamer lends and streams, run by its forward",
            in_source_of=("__init__", "forward")),
    Contact(f"{_LLAMA}.LlamaForCausalLM.model", _ATTRIBUTE,
            "the module whose call brackets a forward pass for the layer streamer",
            in_source_of=("__init__", "forward")),
    Contact("sglang.srt.model_executor.forward_batch_info.ForwardBatch.forward_mode",
            _ATTRIBUTE, "a pass's batch kind: the layer streamer times decode passes "
            "(streaming.is_decode)"),
    Contact("sglang.srt.model_executor.forward_batch_info.ForwardMode.is_decode", _METHOD,
            "whether a pass is a decode step, whose compute an active model's copies fit"),
)

_QUANT = "sglang.srt.layers.quantization"
_QUANT_CONFIG = f"{_QUANT}.base_config.QuantizationConfig"
_LINEAR_METHOD = f"{_QUANT}.base_config.LinearMethodBase"
#: The `fineslab_qoq` linear method (qoq_method.py): a QuantizationConfig and LinearMethodBase
#: of SGLang's, built by its model loader. `register()` checks these rows where it registers
#: the method (`install.wants_qoq`), before it adds it to the dicts of `_QUANT` (whose identity
#: it checks itself: a row cannot name a module's dict).
QOQ_CONTACTS: tuple[Contact, ...] = (
    Contact(_QUANT, Kind.MODULE, "holds QUANTIZATION_METHODS, the dict fineslab_qoq joins"),
    Contact("sglang.srt.configs.model_config", Kind.MODULE,
            "ModelConfig accepts a quant_method its QUANTIZATION_METHODS (the same dict) holds"),
    Contact(_QUANT_CONFIG, Kind.CLASS, "QoQLinearConfig's base"),
    Contact(f"{_QUANT_CONFIG}.__init__", _METHOD, "called by QoQLinearConfig.__init__"),
    Contact(f"{_QUANT_CONFIG}.from_config", _METHOD,
            "the loader builds the config from config.json's quantization_config",
            ("config",)),
    Contact(f"{_QUANT_CONFIG}.get_quant_method", _METHOD,
            "gives each linear layer its method", ("layer", "prefix")),
    *_members(_QUANT_CONFIG, _METHOD, (
        "get_name", "get_supported_act_dtypes", "get_min_capability", "get_config_filenames",
        "get_scaled_act_names"), "overridden: what the loader asks of every method"),
    Contact(_LINEAR_METHOD, Kind.CLASS, "QoQLinearMethod's base"),
    Contact(f"{_LINEAR_METHOD}.create_weights", _METHOD,
            "overridden: the four QoQ tensors of a layer",
            ("layer", "input_size_per_partition", "output_partition_sizes", "input_size",
             "output_size", "params_dtype")),
    Contact(f"{_LINEAR_METHOD}.process_weights_after_loading", _METHOD,
            "overridden: checks the tensors and, off CUDA, caches the INT8 weight", ("layer",)),
    Contact(f"{_LINEAR_METHOD}.apply", _METHOD, "overridden: the W4A8 product",
            ("layer", "x", "bias")),
    Contact("sglang.srt.layers.linear.LinearBase", Kind.CLASS,
            "the layers fineslab_qoq quantizes"),
    Contact(f"{_QUANT}.unquant.UnquantizedLinearMethod", Kind.CLASS,
            "for a linear layer the QoQ writer left 16-bit"),
    Contact("sglang.srt.server_args.add_quantization_method_choices", Kind.FUNCTION,
            "SGLang's own way to add a --quantization choice"),
    Contact("sglang.srt.utils.set_weight_attrs", Kind.FUNCTION,
            "gives the QoQ tensors SGLang's loader and their output/input dims",
            ("weight", "weight_attrs")),
)

_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_ATTENTION_REGISTRY = "sglang.srt.layers.attention.attention_registry"
#: The `fineslab_kv4` attention backend (kv4_backend.py): torch_native with the KV4 Triton
#: decode. `register()` checks these rows where it registers the backend
#: (`install.wants_kv4_backend`).
KV4_BACKEND_CONTACTS: tuple[Contact, ...] = (
    Contact(_TORCH_NATIVE, Kind.CLASS, "Kv4AttnBackend's base: its extend and fallback decode"),
    Contact(f"{_TORCH_NATIVE}.__init__", _METHOD, "Kv4AttnBackend keeps its constructor",
            ("model_runner",)),
    Contact(f"{_TORCH_NATIVE}.forward_decode", _METHOD,
            "overridden: the KV4 kernel; the fallback calls it",
            ("q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    *_members(_TORCH_NATIVE, _ATTRIBUTE, ("token_to_kv_pool", "req_to_token_pool"),
              "the KV4 pool the kernel reads and the request -> slot table",
              in_source_of=("__init__",)),
    Contact("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.req_to_token", _ATTRIBUTE,
            "[requests, context] slot table the kernel walks", in_source_of=("__init__",)),
    *_members(_FORWARD_BATCH, _ATTRIBUTE, ("out_cache_loc", "req_pool_indices", "seq_lens"),
              "the decode step's write slots, requests and lengths"),
    *_members(_ATTENTION, _ATTRIBUTE, (
        "tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim", "scaling",
        "is_cross_attention", "sliding_window_size"),
        "the decode geometry, sm_scale, and what the kernel does not cover",
        in_source_of=("__init__",)),
    Contact(_ATTENTION_REGISTRY, Kind.MODULE, "holds ATTENTION_BACKENDS, which fineslab_kv4 joins"),
    Contact(f"{_ATTENTION_REGISTRY}.register_attention_backend", Kind.FUNCTION,
            "SGLang's own way to add an attention backend", ("name",)),
    Contact("sglang.srt.server_args.add_attention_backend_choices", Kind.FUNCTION,
            "SGLang's own way to add an --attention-backend choice"),
)

_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
_REQ = "sglang.srt.managers.schedule_batch.Req"
#: Read by the lent tier and the engine policy (one row, in both tables).
_REQ_RID = Contact(f"{_REQ}.rid", _ATTRIBUTE, "a request's id", in_source_of=("__init__",))
_BASE_CACHE = "sglang.srt.mem_cache.base_prefix_cache"
#: The `fineslab_lent` radix-cache backend (prefix_tier.py): `install` checks these where the
#: join asks for a lent tier (`ArenaJoin.prefix_lending`).
PREFIX_TIER_CONTACTS: tuple[Contact, ...] = (
    Contact("sglang.srt.mem_cache.registry.register_radix_cache_backend", Kind.FUNCTION,
            "SGLang's own way to add a --radix-cache-backend", ("name", "factory")),
    *_members("sglang.srt.mem_cache.registry.TreeCacheBuildContext", _ATTRIBUTE,
              ("params", "disable_radix_cache"), "what the backend factory reads"),
    Contact(_RADIX, Kind.CLASS, "LentRadixCache's base: the tree, insert, lock refs"),
    Contact(f"{_RADIX}.__init__", _METHOD, "LentRadixCache keeps its constructor", ("params",)),
    Contact(f"{_RADIX}.evict", _METHOD, "overridden: victims go to the lent tier first",
            ("params",)),
    Contact(f"{_RADIX}.match_prefix", _METHOD, "overridden: lent pages past the tree's match",
            ("params",)),
    Contact(f"{_RADIX}.init_load_back", _METHOD,
            "overridden: SGLang calls it to load a host hit before the prefill",
            ("params",), in_source_of=()),
    Contact(f"{_RADIX}.on_release", _METHOD, "overridden: a request's marker dropped",
            ("req", "checkpointed")),
    Contact(f"{_RADIX}.reset", _METHOD, "overridden: the markers cleared with the tree"),
    *_members(_RADIX, _METHOD, ("_delete_leaf", "_update_leaf_status",
                                "update_eviction_metrics"),
              "the tree's own bookkeeping, called as SGLang's evict calls it"),
    *_members(_RADIX, _ATTRIBUTE, (
        "disable", "page_size", "evictable_leaves", "eviction_strategy", "kv_events",
        "token_to_kv_pool_allocator"),
        "the tree's settings and parts the overrides use", in_source_of=("__init__",)),
    *_members(_RADIX, _ATTRIBUTE, ("root_node", "evictable_size_"),
              "the tree's root and evictable count the overrides read and update",
              in_source_of=("reset",)),
    *_members("sglang.srt.mem_cache.radix_cache.TreeNode", _ATTRIBUTE, (
        "key", "value", "parent", "children", "lock_ref", "priority"),
        "a node of the tree, as evict and load back walk and attach them",
        in_source_of=("__init__",)),
    *_members("sglang.srt.mem_cache.radix_cache.RadixKey", _METHOD, (
        "page_aligned", "raw_token_ids", "child_key"), "a key's pages, tokens and child key"),
    *_members("sglang.srt.mem_cache.radix_cache.RadixKey", _ATTRIBUTE, (
        "extra_key", "cache_salt"), "a key's namespace (the first page hash)",
        in_source_of=("__init__",)),
    *_members(f"{_BASE_CACHE}.MatchResult", _ATTRIBUTE, (
        "device_prefix_len", "last_device_node", "host_hit_length"),
        "the match the tier extends with a host hit"),
    *_members(f"{_BASE_CACHE}.InitLoadBackParams", _ATTRIBUTE, (
        "best_match_node", "host_hit_length", "req"), "the load SGLang asks for"),
    Contact(f"{_BASE_CACHE}.MatchPrefixParams.req", _ATTRIBUTE, "whose match it is"),
    Contact(f"{_BASE_CACHE}.EvictParams.num_tokens", _ATTRIBUTE, "how much to evict"),
    Contact(f"{_BASE_CACHE}.EvictResult.num_tokens_evicted", _ATTRIBUTE, "what was evicted"),
    _REQ_RID,
    Contact(f"{_SERVER_ARGS}.radix_cache_backend", _ATTRIBUTE,
            "a join asking for the lent tier refuses a runtime on another radix cache"),
)

#: The engine policy (engine_policy.py): Algorithm 2 over SGLang's waiting queue, checked where
#: the environment asks for it (`FINESLAB_ENGINE_POLICY`).
ENGINE_POLICY_CONTACTS: tuple[Contact, ...] = (
    *_members(_SCHEDULER, _ATTRIBUTE, ("waiting_queue", "tp_size"),
              "the engine policy reads and reorders the queue (one rank only)",
              in_source_of=("init_running_status",)),
    Contact(f"{_SCHEDULER}.chunked_req", _ATTRIBUTE, "the prefill already under way",
            in_source_of=("init_chunked_prefill",)),
    *_members(_SCHEDULER, _ATTRIBUTE, ("max_running_requests", "max_prefill_tokens"),
              "N_max and T_max of the engine policy", in_source_of=("init_model_worker",)),
    Contact(f"{_SCHEDULER}.abort_request", _METHOD,
            "drops a waiting request through SGLang's own abort path (answered 429)",
            ("recv_req",)),
    Contact("sglang.srt.managers.io_struct.AbortReq", Kind.CLASS,
            "the abort the engine policy sends (rid, finished_reason with status_code)"),
    *_members("sglang.srt.managers.io_struct.AbortReq", _ATTRIBUTE,
              ("rid", "finished_reason"), "fields of the engine policy's abort"),
    _REQ_RID,
    *_members(_REQ, _ATTRIBUTE, ("priority", "origin_input_ids", "output_ids", "prefix_len",
                                 "extend_end"),
              "a waiting request's deadline (the router's priority), prompt, whether it "
              "already produced tokens, and how much of a chunked request is prefilled (up to "
              "the end of the chunk its last step extended)", in_source_of=("__init__",)),
    Contact(f"{_BATCH}.reqs", _ATTRIBUTE, "the running requests, for N_max"),
    Contact(f"{_SCHEDULER}.tree_cache", _ATTRIBUTE, "its evictable tokens count for T_max",
            in_source_of=("__init__",)),
    Contact("sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.evictable_size", _METHOD,
            "T_max: KV tokens the prefix cache would give back"),
    Contact("sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.evict", _METHOD,
            "the cache squeeze: least recently used prefixes given back for a neighbour",
            ("params",)),
    Contact("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.available_size",
            _METHOD, "T_max: free KV tokens now"),
    Contact(f"{_SCHEDULER}.forward_ct", _ATTRIBUTE,
            "batches run so far: a prefill step is timed only when it ran alone "
            "(step_refresh.StepClock)", in_source_of=("run_batch",)),
    Contact(f"{_BATCH}.extend_num_tokens", _ATTRIBUTE,
            "the new tokens of the prefill batch the engine policy's predictor times"),
)

#: What a runtime joining an arena relies on: `install` checks these (not QOQ_CONTACTS or
#: KV4_BACKEND_CONTACTS, which only a runtime serving a QoQ checkpoint or naming fineslab_kv4
#: needs, checked where the method or backend is registered).
ARENA_CONTACTS: tuple[Contact, ...] = (
    *_HOOKS, *_REGISTRY_CONTACTS, *_RUNNER_STATE, *_SCHEDULER_STATE, *_ALLOCATOR_CONTACTS,
    *_POOL_CONTACTS, *_STREAMING_CONTACTS)
#: Every SGLang name the plugin relies on.
CONTACTS: tuple[Contact, ...] = tuple(dict.fromkeys((
    *ARENA_CONTACTS, *QOQ_CONTACTS, *KV4_BACKEND_CONTACTS, *PREFIX_TIER_CONTACTS,
    *ENGINE_POLICY_CONTACTS)))
#: What a runtime with an engine schedule and no arena relies on (`SchedulingSession`): the
#: prefill hook and the registry, and the engine policy's rows.
SCHEDULING_CONTACTS: tuple[Contact, ...] = (
    *(c for c in _HOOKS if c.hook == "new_batch_prefill"), *_REGISTRY_CONTACTS,
    *ENGINE_POLICY_CONTACTS)

#: The rows the plugin wraps with AROUND hooks, in the order SGLang calls them.
HOOK_TARGETS: tuple[Contact, ...] = tuple(c for c in ARENA_CONTACTS if c.hook is not None)

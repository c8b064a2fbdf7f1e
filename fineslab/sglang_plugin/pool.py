"""SlabKVPool: SGLang's MHA KV pool whose per-layer buffers are views into the slab arena.

Glossary
    arena        the device's shared KV bytes (1-D uint8), see `fineslab.slabs`
    slot         one token's KV for every layer; slot s starts at byte s * token_stride
    page         SGLang's unit of allocation = one block of `tokens_per_block` slots
    k_buffer[l]  [num_rows, kv_heads, head_dim] view: row s = layer l's K of slot s

Layout (one model's view of the arena; `fineslab/slabs/views.py` has the byte detail):

    arena:  | slot 0 | slot 1 | slot 2 | ...           (row stride = token_stride bytes)
    slot:   | K0 V0 | K1 V1 | ... | K(L-1) V(L-1) | pad |
    k_buffer[l][s] = K of layer l in slot s;  v_buffer[l][s] = V of layer l in slot s

Invariants
    num_rows = arena_bytes // token_stride >= size + page_size
    k_buffer[l].stride(0) == v_buffer[l].stride(0) == token_stride / elem_bytes
    k_buffer[l].stride(2) == 1     (the last dim is contiguous: all that triton, flashinfer and
                                    torch_native need)

Because only the buffers' identity changes, SGLang's stock read/write paths (`set_kv_buffer`,
`get_key_buffer`, the attention backends) run unmodified; building the views costs nothing and
allocates nothing. Paths that need one contiguous buffer per layer are refused here as well as at
start-up (`refusals.py`), so a mis-configured runtime fails instead of touching a neighbour's KV.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from fineslab.errors import ConfigError
from fineslab.slabs.views import LayerKV

logger = logging.getLogger(__name__)


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f"SlabKVPool: {what} needs one contiguous KV buffer per layer; the slab arena gives "
        "strided views into shared memory. Start this runtime without FINESLAB_ARENA to use it.")


class SlabKVPool(MHATokenToKVPool):
    """An `MHATokenToKVPool` over arena views; make one with `SlabKVPool.over(views)`.

    SGLang builds the pool itself (`pool_cls(size, page_size=..., dtype=..., ...)`), so the views
    travel on a subclass made per runtime rather than through the constructor.
    """

    arena_views: ClassVar[Sequence[LayerKV]] = ()

    @classmethod
    def over(cls, views: Sequence[LayerKV]) -> type[SlabKVPool]:
        """A SlabKVPool class whose instances use `views` (one per layer) as their buffers."""
        if not views:
            raise ConfigError("SlabKVPool needs at least one layer view")
        return type(cls.__name__, (cls,), {"arena_views": tuple(views)})

    # -- buffers ----------------------------------------------------------------------------

    def _create_buffers(self) -> None:
        """Point k_buffer/v_buffer at the arena instead of allocating (SGLang calls this)."""
        if self.post_capture_active:
            raise _refuse("post-capture KV backing")
        if self.is_quantized_kv_cache:
            raise _refuse(f"the {type(self.quant_method).__name__} KV quantization method")
        if self.kv_cache_layout != "nhd":
            raise _refuse(f"the {self.kv_cache_layout!r} KV layout")
        self._check_views(int(self.size) + self.page_size)  # type: ignore[has-type]
        self.k_scale_buffer = None
        self.v_scale_buffer = None
        self.native_k_scale_buffer = None
        self.native_v_scale_buffer = None
        self.dq_k_buffer = None
        self.dq_v_buffer = None
        # Every slot of the arena, not just `size + page_size`: under --max-total-tokens SGLang's
        # `size` only caps how much this runtime uses, while its blocks may sit anywhere.
        self.k_buffer = [view.k for view in self.arena_views]
        self.v_buffer = [view.v for view in self.arena_views]
        # SGLang bounds KV writes by `size + page_size` (store_cache's size_limit): cover them all.
        self.size = self.k_buffer[0].shape[0] - self.page_size
        # The descriptors serve PD transfer and post-capture backing, both refused.
        self._kv_buffer_descs: list[Any] = []
        self._init_data_ptrs_and_strides()
        k0 = self.k_buffer[0]
        logger.info("SlabKVPool: %d layers x %d slots over the arena, row stride %d B",
                    self.layer_num, k0.shape[0], k0.stride(0) * k0.element_size())

    def _check_views(self, num_rows: int) -> None:
        """The views must have exactly the geometry SGLang derived from the model config."""
        views = self.arena_views
        if len(views) != self.layer_num:
            raise ConfigError(
                f"SlabKVPool: the arena format has {len(views)} layers, SGLang's model "
                f"{self.layer_num}: the runtime's block format does not match its model")
        k0 = views[0].k
        expected = (self.head_num, self.head_dim)
        if tuple(k0.shape[1:]) != expected or k0.dtype != self.store_dtype:
            raise ConfigError(
                f"SlabKVPool: arena views are {tuple(k0.shape[1:])} {k0.dtype}, SGLang expects "
                f"{expected} {self.store_dtype}: the runtime's block format does not match")
        if self.v_head_dim != self.head_dim:
            raise ConfigError("SlabKVPool: models with v_head_dim != head_dim are not supported")
        if k0.shape[0] < num_rows:
            raise ConfigError(
                f"SlabKVPool: the arena has {k0.shape[0]} slots of this format, SGLang asks "
                f"for {num_rows}")
        if k0.device.type != torch.device(self.device).type:
            raise ConfigError(f"SlabKVPool: arena on {k0.device}, runtime on {self.device}")

    def _clear_buffers(self) -> None:
        # The arena outlives this runtime; dropping the views is all there is to release.
        self.k_buffer = []
        self.v_buffer = []

    # -- paths that assume contiguous per-layer buffers --------------------------------------

    def get_contiguous_buf_infos(self) -> Any:
        raise _refuse("PD disaggregation / HiCache buffer registration")

    def get_cpu_copy(self, indices: Any, mamba_indices: Any = None,
                     req_pool_index: Any = None) -> Any:
        raise _refuse("CPU KV offload")

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None,
                      req_pool_index: Any = None) -> Any:
        raise _refuse("CPU KV offload")

    def _init_kv_copy_and_warmup(self) -> None:
        raise _refuse("speculative decoding's KV copy")

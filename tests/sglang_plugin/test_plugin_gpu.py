"""On a GPU: the slab pool under SGLang's triton and flashinfer backends, BF16 and FP8 KV, at
page 16 and at page 20 (not a power of two: the plugin's torch slot path, as key-sharing plans
need); and CUDA-graph padding and stale bytes, which only a GPU produces.

Greedy output with the plugin must equal output with SGLang's own pool (same engine arguments).
Marked `gpu`: skipped by the default CPU suite; run by scripts/gpu_check.sh where CUDA exists.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from plugin_test_support import joined, prompts, whole_page_chunk

from fineslab.runtime import shutdown_engine, start_engine
from fineslab.sglang_plugin import ArenaJoin
from fineslab.slabs import ArenaSpec, KVDtype, KVShape, SlabArena
from fineslab.slabs.sizing import fit_format

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = prompts(4, 40, seed=5)


def _outputs(model_path: Path, backend: str, kv_cache_dtype: str, page_size: int,
             join: ArenaJoin | None, input_ids: list[list[int]] = PROMPTS) -> list[list[int]]:

    kwargs: dict[str, object] = dict(
        model_path=str(model_path), dtype="bfloat16", log_level="error", page_size=page_size,
        attention_backend=backend, kv_cache_dtype=kv_cache_dtype, mem_fraction_static=0.3)
    if join is None:
        kwargs["max_total_tokens"] = 8192
    kwargs.update(whole_page_chunk(page_size))
    with joined(join):
        engine = start_engine(**kwargs)
    try:
        out = engine.generate(input_ids=input_ids, sampling_params={
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    finally:
        shutdown_engine(engine)
    return [o["output_ids"] for o in out]


@pytest.mark.parametrize("page_size", [16, 20])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backends_match_stock_pool(model_cache: Path, backend: str, kv_cache_dtype: str,
                                       page_size: int) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv = KVDtype.FP8_E4M3 if kv_cache_dtype == "fp8_e4m3" else KVDtype.BF16
    slab_bytes = (1 << 20) if page_size == 16 else (5 << 18)  # a multiple of the block
    fmt = fit_format(KVShape("m", 4, 2, 64, kv), slab_bytes, [page_size])
    assert fmt is not None
    fleet = f"g{uuid.uuid4().hex[:8]}"
    arena = SlabArena.create(ArenaSpec(fleet, "cuda:0", 16 * slab_bytes, slab_bytes,
                                       fmt.blocks_per_slab(slab_bytes)))
    try:
        plugin = _outputs(model_cache / "llama-tiny", backend, kv_cache_dtype, page_size,
                          ArenaJoin(fleet, "m"))
    finally:
        arena.close()
    stock = _outputs(model_cache / "llama-tiny", backend, kv_cache_dtype, page_size, None)
    assert plugin == stock, (f"{backend} {kv_cache_dtype} page {page_size}: slab pool output "
                             "differs from stock")


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_graph_padding_lands_in_the_padding_slab_and_stale_nan_never_leaks(
        model_cache: Path, backend: str) -> None:
    """With CUDA graphs on (SGLang's default on CUDA), three requests decode in a graph of
    four: the padded row writes slot 0, byte 0 of the arena, inside the padding slab. The arena
    starts filled with 0xFF bytes (NaN in bf16: what another format's stale KV can look like),
    so output equal to stock also shows that no page SGLang got was read before being written
    or zeroed (`needs_zeroed_pages`)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    page_size, slab_bytes = 16, 1 << 20
    fmt = fit_format(KVShape("m", 4, 2, 64, KVDtype.BF16), slab_bytes, [page_size])
    assert fmt is not None
    fleet = f"g{uuid.uuid4().hex[:8]}"
    arena = SlabArena.create(ArenaSpec(fleet, "cuda:0", 16 * slab_bytes, slab_bytes,
                                       fmt.blocks_per_slab(slab_bytes)))
    three = PROMPTS[:3]
    try:
        data = arena.tensor()
        data.fill_(0xFF)  # type: ignore[attr-defined]
        plugin = _outputs(model_cache / "llama-tiny", backend, "auto", page_size,
                          ArenaJoin(fleet, "m"), input_ids=three)
        slot0 = data[: fmt.token_stride_bytes]  # type: ignore[index]
        assert not bool((slot0 == 0xFF).all()), (
            "padded (graph) writes must have reached slot 0: the padding slab")
    finally:
        arena.close()
    stock = _outputs(model_cache / "llama-tiny", backend, "auto", page_size, None, input_ids=three)
    assert plugin == stock, f"{backend}: padded graph / stale-NaN arena changed the output"

"""Streamed layers' copies (fineslab.slabs.layer_copy) in a real transformers Llama's forward
pass: identical logits, the copies each pass makes, and a negative control (bytes of the host
copy are what the layer runs with). CPU (`SyncCopies`) here; the copy stream on a GPU below."""

from __future__ import annotations

import pytest
import torch

from fineslab.bench.layer_copy import StreamedLayers, build_llama
from fineslab.slabs.layer_copy import StreamCopies, SyncCopies

HIDDEN, LAYERS, TOKENS = 128, 4, 16


def _logits(model: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits.float().cpu()  # type: ignore[operator]


def _setup(device: str, dtype: torch.dtype) -> tuple[object, torch.Tensor, torch.Tensor]:
    model = build_llama(HIDDEN, LAYERS, 1000, device, dtype)
    ids = torch.randint(0, 1000, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    return model, ids, _logits(model, ids)


@pytest.mark.parametrize(("streamed", "slots", "copies_per_pass"),
                         [((1, 3), 1, 2), ((0, 1, 2, 3), 2, 4), ((1, 3), 2, 0)])
def test_streamed_layers_give_identical_logits_and_copy_only_what_a_slot_lacks(
        streamed: tuple[int, ...], slots: int, copies_per_pass: int) -> None:
    model, ids, reference = _setup("cpu", torch.float32)
    layers = model.model.layers  # type: ignore[attr-defined]
    streaming = StreamedLayers(layers, streamed, slots, "cpu", stack=model.model)  # type: ignore[attr-defined]
    assert isinstance(streaming.copies, SyncCopies)
    first = _logits(model, ids)
    after_first = streaming.copies.copies
    second = _logits(model, ids)
    assert torch.equal(first, reference) and torch.equal(second, reference), \
        "a streamed layer runs with its own bytes"
    assert after_first == len(streamed), "the first pass copies every streamed layer in"
    assert streaming.copies.copies - after_first == copies_per_pass, \
        "later passes copy only into slots that hold another layer"


def test_a_corrupted_host_copy_changes_the_logits() -> None:
    """Negative control: the streamed layer really runs on the bytes copied in."""
    model, ids, reference = _setup("cpu", torch.float32)
    streaming = StreamedLayers(model.model.layers, (1, 3), 1, "cpu",  # type: ignore[attr-defined]
                               stack=model.model)  # type: ignore[attr-defined]
    streaming.host[1, :4096] = 0  # layer 3's first projection, zeroed
    assert not torch.equal(_logits(model, ids), reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("slots", [1, 2])
def test_copies_on_a_copy_stream_give_identical_logits(slots: int) -> None:
    model, ids, reference = _setup("cuda", torch.bfloat16)
    streaming = StreamedLayers(model.model.layers, (1, 2, 3), slots, "cuda",  # type: ignore[attr-defined]
                               stack=model.model)  # type: ignore[attr-defined]
    assert isinstance(streaming.copies, StreamCopies)
    for _ in range(3):
        assert torch.equal(_logits(model, ids), reference), \
            "each layer waits for its copy; no copy overwrites a slot still in use"
    # One slot: every layer every pass (9). Two: layer 2 stays in its slot after the first pass,
    # layers 1 and 3 take turns in the other (3 + 2 + 2).
    assert streaming.copies.copies == (9 if slots == 1 else 7), \
        "a slot holding its layer copies nothing"
    streaming.host[0, :4096] = 0
    assert not torch.equal(_logits(model, ids), reference), "negative control: host bytes used"

"""Streamed layers on a copy stream, in a real model's forward pass (issue #17's GPU path).

`python -m fineslab.bench.layer_copy --device cpu|cuda [--quick] [--json]`

A generated Llama (transformers, random weights, seed 0) runs one prefill forward pass with the
set S of streamed layers (every second layer) held in `--slots` slot buffers and copied from
pinned host memory before each runs (`fineslab.slabs.layer_copy`: `StreamCopies` on a GPU, the
copies ahead on a side stream; `SyncCopies` on CPU). In one run, each time the median of
`--repeats` rounds (5) with its spread (`<figure>_spread`): the resident passes first, then, with
S streamed, the streamed passes and the copies alone in interleaved rounds (the resident pass
cannot be interleaved with them: streaming replaces the layers' weights):

    t_none_s          the pass with every layer resident
    t_copy_s          S's copies alone, one after another on the copy stream
    t_stream_s        the pass with S streamed
    overlap           (t_none + t_copy - t_stream) / min(t_none, t_copy) of the medians: 1 when
                      the copies hide entirely under compute, 0 when they serialize
    copy_gib_s        S's bytes / t_copy
    identical         the streamed pass's logits equal the resident pass's, bit for bit
    saved_bytes       device bytes the streamed layers no longer hold (|S| - slots layers)

The sizes (`--tokens`, the model's width) are chosen so a layer's compute is of the order of
its copy; the decode of a small batch is not (Oneiros lends under prefill-heavy and large-batch
steps; docs/streaming.md). Results go in docs/streaming.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from fineslab.bench.repeats import spread, timed_rounds
from fineslab.slabs.layer_copy import LayerCopies, StreamCopies, SyncCopies, hook_layers
from fineslab.tables import add_json_flag, emit, repeats_arg

ALIGN_BYTES = 256
ROUNDS = 5


def build_llama(hidden: int, layers: int, vocab: int, device: str, dtype: Any) -> Any:
    """A random Llama of the given shape (seed 0), in eval mode on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                         num_key_value_heads=max(1, hidden // 512), vocab_size=vocab,
                         max_position_embeddings=8192)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place, in its dtype: no second copy to convert
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


class StreamedLayers:
    """Layers `streamed` of `layers` moved out of device memory: each one's parameters become
    views of slot `rank % slots` (the layers of one slot share its bytes, as the weight region
    maps them), its bytes kept in one host buffer (pinned on CUDA), copied in by `copies`."""

    def __init__(self, layers: Sequence[Any], streamed: Sequence[int], slots: int,
                 device: Any, stack: Any = None) -> None:
        import torch

        self.order = sorted(streamed)
        params = [list(layers[i].parameters()) for i in self.order]
        offsets, end = [], 0
        for p in params[0]:
            offsets.append(end)
            end += -(-p.numel() * p.element_size() // ALIGN_BYTES) * ALIGN_BYTES
        self.layer_bytes = end
        cuda = torch.device(device).type == "cuda"
        self.host = torch.empty((len(self.order), end), dtype=torch.uint8, pin_memory=cuda)
        self.slots = [torch.empty(end, dtype=torch.uint8, device=device) for _ in range(slots)]
        for rank, layer_params in enumerate(params):
            slot = self.slots[rank % slots]
            for p, at in zip(layer_params, offsets, strict=True):
                nbytes = p.numel() * p.element_size()
                self.host[rank, at: at + nbytes].copy_(p.detach().reshape(-1).view(torch.uint8))
                p.data = slot[at: at + nbytes].view(p.dtype).view(p.shape)
        self.rank = {layer: r for r, layer in enumerate(self.order)}
        copy = self._copy
        self.copies: LayerCopies = (StreamCopies(self.order, slots, copy, device) if cuda
                                    else SyncCopies(self.order, slots, copy))
        self._handles = hook_layers(layers, self.copies, stack)

    def _copy(self, layer: int) -> None:
        rank = self.rank[layer]
        self.slots[rank % len(self.slots)].copy_(self.host[rank], non_blocking=True)

    def copy_all(self) -> None:
        """Every streamed layer's copy, one after another (the copy chain alone)."""
        for rank in range(len(self.order)):
            self.slots[rank % len(self.slots)].copy_(self.host[rank], non_blocking=True)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def measure(device: str, hidden: int, num_layers: int, tokens: int, slots: int,
            rounds: int = ROUNDS) -> dict[str, Any]:
    import torch

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_llama(hidden, num_layers, 32000, device, dtype)
    ids = torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def forward() -> Any:
        with torch.inference_mode():
            return model(ids).logits

    reference = forward().float().cpu()
    times = timed_rounds({"none": forward}, sync, rounds)
    streamed = StreamedLayers(model.model.layers, range(1, num_layers, 2), slots, device,
                              stack=model.model)
    if cuda:
        torch.cuda.empty_cache()
    got = forward().float().cpu()

    def copy_all() -> None:
        if cuda:
            with torch.cuda.stream(streamed.copies.copy_stream):  # type: ignore[attr-defined]
                streamed.copy_all()
        else:
            streamed.copy_all()

    times.update(timed_rounds({"stream": forward, "copy": copy_all}, sync, rounds))
    t_none, t_stream, t_copy = (statistics.median(times[k]) for k in ("none", "stream", "copy"))
    s_bytes = len(streamed.order) * streamed.layer_bytes
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "hidden": hidden, "layers": num_layers, "tokens": tokens, "slots": slots,
        "streamed_layers": len(streamed.order), "layer_bytes": streamed.layer_bytes,
        "rounds": rounds,
        "t_none_s": round(t_none, 6), "t_copy_s": round(t_copy, 6),
        "t_stream_s": round(t_stream, 6),
        **{f"t_{k}_s_spread": spread(v, 6) for k, v in times.items()},
        # On CPU the copies are synchronous: there is no overlap to measure.
        "overlap": (round((t_none + t_copy - t_stream) / min(t_none, t_copy), 3) if cuda
                    else None),
        "copy_gib_s": round(s_bytes / t_copy / 2**30, 2),
        "identical": bool(torch.equal(got, reference)),
        "saved_bytes": (len(streamed.order) - slots) * streamed.layer_bytes,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineslab.bench.layer_copy",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--slots", type=int, default=2, choices=(1, 2))
    parser.add_argument("--quick", action="store_true",
                        help="a small model and pass (CPU smoke run)")
    parser.add_argument("--repeats", type=repeats_arg, default=ROUNDS,
                        help=f"timed rounds of each pass and of the copies (default {ROUNDS})")
    add_json_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick or not args.device.startswith("cuda"):
        figures = measure(args.device, 256, 4, 64, args.slots, args.repeats)
    else:
        figures = measure(args.device, 4096, 8, 4096, args.slots, args.repeats)
    emit("streamed layers on a copy stream (medians of the rounds)", ["figure", "value"],
         [(k, v) for k, v in figures.items() if not k.endswith("_spread")], figures, args.json)
    return 0 if figures["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

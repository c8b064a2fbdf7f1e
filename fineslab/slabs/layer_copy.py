"""When a streamed layer's bytes are copied into its slot: ahead of the layer, on a copy stream
(issue #17's GPU path; Oneiros section 4.3).

The layer streamer (sglang_plugin/streaming.py) maps each streamed layer's range onto one of
`slots` slot buffers: the layer of rank r in S (forward order) uses slot r mod slots. This module
decides the copies of one forward pass and, on a GPU, runs them on a side stream:

    begin_pass      the copies of ranks 0 .. slots-1 are issued at once (each after the last
                    kernels of the slot's previous user, from the pass before)
    before layer r  the compute stream waits for the event `ready[r]`: r's bytes have landed
    after layer r   `done[slot]` is recorded on the compute stream, then the copy of rank
                    r + slots (same slot) is issued on the copy stream after `done[slot]`
    a slot already holding its layer (|S| <= slots, from the pass before) copies nothing

so the copy of rank r + slots runs under the compute of ranks r+1 .. r+slots-1 and every
unstreamed layer between them: with T_T the copy and T_c a layer's compute, it hides when
T_T <= (gap to the slot's next user) * T_c (the paper's equations 4 and 5 pick `slots`).

    copies issued in a pass == |S| - (slots already holding their layer)
    the layer of rank r never runs before ready[r]; no copy into slot k starts before the
    kernels of its previous user are done (done[k])

On CPU (`SyncCopies`) the copy runs in `before_layer`, synchronously. `copies_for(device, ...)`
picks the engine by the device the weights live on (the plugin's streamer calls it).
Events and streams are torch's; nothing here allocates device memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

#: Enqueue the copy of layer `layer`'s bytes into its range, on the current stream.
CopyFn = Callable[[int], None]


class LayerCopies(Protocol):
    """The streamer's view of a copy engine (SyncCopies on CPU, StreamCopies on a GPU)."""

    copies: int

    def slot(self, layer: int) -> int: ...
    def begin_pass(self) -> None: ...
    def before_layer(self, layer: int) -> None: ...
    def after_layer(self, layer: int) -> None: ...


class _Plan:
    """S in forward order and each layer's slot; which layer each slot holds."""

    def __init__(self, streamed: Sequence[int], slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.order = sorted(streamed)
        self.rank = {layer: r for r, layer in enumerate(self.order)}
        self.slots = slots
        self.holds: list[int | None] = [None] * slots

    def slot(self, layer: int) -> int:
        return self.rank[layer] % self.slots

    def needs_copy(self, layer: int) -> bool:
        return self.holds[self.slot(layer)] != layer


class SyncCopies:
    """CPU: each streamed layer's copy runs just before it, on the calling thread."""

    def __init__(self, streamed: Sequence[int], slots: int, copy: CopyFn) -> None:
        self._plan, self._copy = _Plan(streamed, slots), copy
        self.copies = 0

    def slot(self, layer: int) -> int:
        """The slot streamed layer `layer` runs from: its rank in S mod the slots."""
        return self._plan.slot(layer)

    @property
    def holds(self) -> tuple[int | None, ...]:
        """The layer each slot holds now (None: nothing copied in yet)."""
        return tuple(self._plan.holds)

    def begin_pass(self) -> None:
        return

    def before_layer(self, layer: int) -> None:
        plan = self._plan
        if layer in plan.rank and plan.needs_copy(layer):
            self._copy(layer)
            plan.holds[plan.slot(layer)] = layer
            self.copies += 1

    def after_layer(self, layer: int) -> None:
        return


class StreamCopies:
    """GPU: the copies on `copy_stream`, ordered against the compute stream by events (module
    doc). Build one per S; call begin_pass / before_layer / after_layer from the forward hooks,
    on the thread that launches the model's kernels."""

    def __init__(self, streamed: Sequence[int], slots: int, copy: CopyFn, device: Any,
                 copy_stream: Any = None) -> None:
        import torch

        self._plan, self._copy, self._device = _Plan(streamed, slots), copy, device
        self.copy_stream = copy_stream or torch.cuda.Stream(device)
        self._ready: dict[int, Any] = {}
        self._done: list[Any | None] = [None] * slots
        self.copies = 0

    def slot(self, layer: int) -> int:
        """The slot streamed layer `layer` runs from: its rank in S mod the slots."""
        return self._plan.slot(layer)

    def _issue(self, layer: int) -> None:
        import torch

        plan = self._plan
        if not plan.needs_copy(layer):
            return
        slot = plan.slot(layer)
        with torch.cuda.stream(self.copy_stream):
            done = self._done[slot]
            if done is not None:
                self.copy_stream.wait_event(done)
            self._copy(layer)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        self._ready[layer] = ready
        plan.holds[slot] = layer
        self.copies += 1

    def begin_pass(self) -> None:
        for layer in self._plan.order[: self._plan.slots]:
            self._issue(layer)

    def before_layer(self, layer: int) -> None:
        import torch

        if layer not in self._ready and layer in self._plan.rank:
            self._issue(layer)  # not prefetched (no begin_pass, or S changed): copy it now
        ready = self._ready.pop(layer, None)
        if ready is not None:
            torch.cuda.current_stream(self._device).wait_event(ready)

    def after_layer(self, layer: int) -> None:
        import torch

        plan = self._plan
        rank = plan.rank.get(layer)
        if rank is None:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._device))
        self._done[plan.slot(layer)] = done
        following = rank + plan.slots
        if following < len(plan.order):
            self._issue(plan.order[following])


def copies_for(device: Any, streamed: Sequence[int], slots: int, copy: CopyFn) -> LayerCopies:
    """The copy engine for weights on `device` (a torch device or its name): `StreamCopies` on
    a CUDA device (the copies ahead, on a side stream of that device), `SyncCopies` elsewhere."""
    import torch

    if torch.device(device).type == "cuda":
        return StreamCopies(streamed, slots, copy, torch.device(device))
    return SyncCopies(streamed, slots, copy)


def hook_layers(layers: Sequence[Any], copies: LayerCopies, model: Any = None) -> list[Any]:
    """Forward hooks on `layers` (decoder layers, index = position) driving `copies`, and a
    pre-hook on `model` (the decoder stack) that begins each pass. Returns the handles."""
    handles = []
    if model is not None:
        handles.append(model.register_forward_pre_hook(lambda *_: copies.begin_pass()))
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda *_, i=index: copies.before_layer(i)))
        handles.append(layer.register_forward_hook(lambda *_, i=index: copies.after_layer(i)))
    return handles

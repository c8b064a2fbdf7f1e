"""The layer streamer (issue #17): some decoder layers' weights lent to the arena as KV room,
streamed back from the host copy just before each of them runs.

A runtime with `FINESLAB_LAYER_STREAMING=1` has each decoder layer on whole slabs of its own
(`LayerSpan`, laid out by weights.py). For the set S of streamed layers:

    lend     layer l in S: its slabs go back to the arena (FREE: KV for anyone) and its range
             becomes inaccessible (`WeightRegion.lend`)
    slots    `slots` (1 or 2) slot buffers of the widest layer's slab count, taken from the
             arena once S is not empty (they are weight slabs of this runtime)
    map      while S and the slots stay, the range of layer l in S is mapped onto slot
             k = (l's rank in S) mod `slots` (`WeightRegion.alias`: the layer's tensors never
             move): the layers of one slot share its memory
    stream   before layer l in S runs (a forward pre-hook), if its slot holds another layer,
             l's bytes are copied in from the host copy, through l's own addresses (mapped
             once, so the copy runs at a warm copy's speed: a first write after a fresh
             mapping ran 4-5x slower here, 2.5 against 10-14 GiB/s); a slot that already
             holds l copies nothing
    revert   layer l leaves S: slabs of its own are taken again (`reclaim`) and its bytes
             restored from the host copy

S changes only between forward passes: a pre-hook and a hook on the model bracket each pass
with `lock`, and the watcher thread applies a new request (streamctl) under it. The same hooks
time each decode pass, less the copies in it (`decode_compute_s`): the compute an active
model's copies would have to hide under (fleet/layer_lending.py). Which copies a pass makes is
slabs/layer_copy.py's plan, run by the engine `copies_for` picks for the weights' device:
    CPU   `SyncCopies`: a synchronous copy before the layer (its cost is the `streamed_bytes`
          the state reports, timed by bench.streaming)
    CUDA  `StreamCopies`: the copies ahead on a copy stream, ordered against the compute
          stream by events (begin_pass, before and after each layer); the host copy is pinned
          (`PinnedHostCopy`) so each copy is a DMA that runs under compute. `copy_seconds`
          then times the enqueueing only, and `decode_compute_s` the host's side of the pass
          (the kernels run asynchronously): GPU timings would need CUDA events (not built).

    arena gain == (lent layers' slabs - slot slabs) * slab_bytes    (StreamState.net_lent_bytes)
    S empty    <=> no lent slab, no slot: the runtime holds exactly its weights' slabs
    every layer's tensors: always at the same addresses; their own bytes while the layer runs
    (a streamed layer's range shows its slot, i.e. maybe another streamed layer's bytes,
    between its turns; while S or the slots change, every lent range is inaccessible)

The host copy is written at start, from the resident weights (before anything is lent), and
shared with the sleeper, which may not read lent layers' ranges.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fineslab.errors import ArenaExhausted, ConfigError
from fineslab.sglang_plugin.weights import LayerSpan, decoder_layers, layers_owner
from fineslab.slabs.layer_copy import LayerCopies, copies_for
from fineslab.slabs.streamctl import (
    POLL_S,
    StreamRequest,
    StreamState,
    read_request,
    write_state,
)
from fineslab.slabs.weights import (
    carve_weight_slabs,
    map_host_copy,
    release_weight_slabs,
    write_host_copy,
)

logger = logging.getLogger(__name__)

#: Weight of the newest decode pass in `StreamState.decode_compute_s`.
DECODE_EWMA = 0.2


def is_decode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a forward pass of the decoder stack runs a decode batch: its ForwardBatch
    (positional or by keyword) says so. False when none is found (nothing is timed)."""
    for value in (*args, *kwargs.values()):
        mode = getattr(value, "forward_mode", None)
        if mode is not None:
            check = getattr(mode, "is_decode", None)
            return bool(check()) if callable(check) else False
    return False


class LayerStreamer:
    """Streams a runtime's layers in S (module doc). Not thread-safe except through `lock`."""

    def __init__(self, region: Any, spans: Sequence[LayerSpan], host_copy: Path,
                 state_file: Path | None = None) -> None:
        if not spans:
            raise ConfigError("layer streaming: the model has no decoder layers named "
                              "'layers.<i>' to stream")
        self.region = region
        self.spans = {span.layer: span for span in spans}
        self.slab_bytes = region.slab_bytes
        self.lock = threading.RLock()
        self._slot_width = max(span.num_slabs for span in spans)
        self.state = StreamState(num_layers=len(spans),
                                 layer_bytes=self._slot_width * region.slab_bytes)
        self._state_file = state_file
        self._slots: list[list[int]] = []  # arena slab ids of each slot
        # Which layer each slot holds, and the copies (slabs/layer_copy.py): while S and the
        # slots stay mapped (`_map_lent`), else None.
        self._copies: LayerCopies | None = None
        if not host_copy.exists():
            write_host_copy(region, host_copy)
        self._dst = region.tensor()  # the range's addresses never move
        self.device = self._dst.device
        #: The pinned host copy on CUDA (the sleeper wakes from it too), else None.
        self.pinned: Any = None
        self._host_mapping: Any
        if self.device.type == "cuda":
            from fineslab.slabs.weights import PinnedHostCopy

            self.pinned = self._host_mapping = PinnedHostCopy(host_copy, region.nbytes)
        else:
            self._host_mapping = map_host_copy(host_copy, region.nbytes)
        self._host = self._host_mapping.tensor
        self._pass_bytes = 0
        self._pass_start_s = 0.0
        self._pass_copy_s = 0.0
        self._pass_decode = False

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(self.state.layers)

    # S, between forward passes (callers hold `lock`)

    def apply(self, request: StreamRequest) -> None:
        """Make S = request.layers with `request.slots` slots. ConfigError for layers the model
        does not have; ArenaExhausted when the arena has no room for a layer coming back (or
        for slots wider than the lent layers give), with S as it then is in the state.

        Order: the new layers are lent first, and the slots they need are kept from their own
        slabs (`WeightRegion.lend(keep=...)`), so lending needs no free slab: an arena full of
        a neighbour's KV is exactly when a lender is asked. Then the layers leaving S take
        slabs again, and last the slots shrink (so a failed reversion leaves S with its
        slots)."""
        request.check_against(len(self.spans))
        old, new = set(self.state.layers), set(request.layers)
        want = request.slots if new else 0
        self._unmap_lent()
        missing = max(0, want - len(self._slots)) * self._slot_width
        kept: list[int] = []
        for layer in sorted(new - old):
            kept += self.region.lend(list(self.spans[layer].slabs), keep=missing - len(kept))
        self.state.layers = sorted(old | new)
        try:
            self._resize_slots(max(want, len(self._slots)), kept)
        except ArenaExhausted:
            if not self._slots:  # lent layers and no slot to run them in: take them back
                self._revert(sorted(new - old))
                self.state.layers = sorted(old)
            self._map_lent()
            self._account()
            raise
        try:
            self._revert(sorted(old - new))
        except ArenaExhausted:
            self._map_lent()
            raise
        finally:
            self._account()
        self._resize_slots(want)  # fewer slots: after the reversion, which may fail
        self.state.layers = sorted(new)
        self._map_lent()
        self.state.slots = request.slots
        self.state.seq = request.seq
        self.state.error = None
        self._account()
        logger.info("fineslab: streaming layers %s of %r through %d slot(s): %d B lent, %d B "
                    "in slots", self.state.layers, self.region.runtime_id, len(self._slots),
                    self.state.lent_bytes, self.state.slot_bytes)

    def _revert(self, layers: list[int]) -> None:
        """Slabs of their own for `layers` (unmapped from the slots: `_unmap_lent` first),
        their bytes from the host copy."""
        if not layers:
            return
        positions = [p for layer in layers for p in self.spans[layer].slabs]
        self.region.reclaim(positions)
        for layer in layers:
            self._copy_in(self.spans[layer])
        if self.pinned is not None:  # CUDA: landed before any pass reads them
            torch.cuda.synchronize(self.device)

    def _resize_slots(self, count: int, spare: list[int] | None = None) -> None:
        """`count` slots: new ones from `spare` slabs (already this owner's) first, then from
        the arena (ArenaExhausted); spare slabs left over go back to the arena."""
        spare = list(spare or [])
        while len(self._slots) > count:  # (nothing maps them: `_unmap_lent` first)
            self._release(self._slots.pop())
        try:
            while len(self._slots) < count:
                slabs = spare[:self._slot_width]
                if len(slabs) < self._slot_width:
                    slabs += carve_weight_slabs(self.region.table, self.region.slot,
                                                self._slot_width - len(slabs)).tolist()
                spare = spare[self._slot_width:]
                self._slots.append(slabs)
        finally:
            if spare:
                self._release(spare)

    def _map_lent(self) -> None:
        """Map each streamed layer's range onto its slot (slot k = its rank in S mod slots), for
        as long as S and the slots stay: layers sharing a slot share its memory, and the copy
        before a layer runs goes through the layer's own, already mapped, addresses. A slot's
        content is unknown after a remap, so every slot starts empty."""
        if not self.state.layers:
            return
        copies = copies_for(self.device, self.state.layers, len(self._slots), self._stream_in)
        for layer in self.state.layers:
            span = self.spans[layer]
            self.region.alias(list(span.slabs), self._slots[copies.slot(layer)][:span.num_slabs])
        self._copies = copies

    def _unmap_lent(self) -> None:
        """Make every streamed layer's range inaccessible again (before S or the slots change)."""
        self._copies = None
        for layer in self.state.layers:
            self.region.cover(list(self.spans[layer].slabs))

    def _release(self, slabs: list[int]) -> None:
        release_weight_slabs(self.region.table, self.region.slot,
                             np.array(slabs, dtype=np.int64), self.region.runtime_id)

    def _account(self) -> None:
        self.state.lent_bytes = len(self.region.lent_positions()) * self.slab_bytes
        self.state.slot_bytes = len(self._slots) * self._slot_width * self.slab_bytes

    # streaming, inside a forward pass

    def before_layer(self, layer: int) -> None:
        """Put layer `layer`'s weights under its addresses if it is streamed (and its slot
        holds another layer)."""
        if self._copies is not None:
            self._copies.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        """Layer `layer` has been launched: on CUDA, the next copy into its slot may follow."""
        if self._copies is not None:
            self._copies.after_layer(layer)

    @property
    def copies(self) -> int:
        """Copies made through the current mapping of S (0 when S is empty)."""
        return 0 if self._copies is None else self._copies.copies

    def _stream_in(self, layer: int) -> None:
        span = self.spans[layer]
        start_s = time.perf_counter()
        self._copy_in(span)
        took_s = time.perf_counter() - start_s
        self.state.copy_seconds += took_s
        self._pass_copy_s += took_s
        self._pass_bytes += span.end - span.start

    def _copy_in(self, span: LayerSpan) -> None:
        # Non-blocking from pinned memory on CUDA (on the stream StreamCopies made current; a
        # reversion's copy is on the compute stream, before any pass that reads it).
        self._dst[span.start: span.end].copy_(self._host[span.start: span.end],
                                              non_blocking=self.pinned is not None)

    def begin_pass(self, decode: bool = False) -> None:
        self.lock.acquire()
        self._pass_bytes = 0
        self._pass_copy_s = 0.0
        self._pass_decode = decode
        self._pass_start_s = time.perf_counter()
        if self._copies is not None:
            self._copies.begin_pass()  # CUDA: the first slots' copies go ahead now

    def end_pass(self) -> None:
        try:
            state = self.state
            state.passes += 1
            state.streamed_bytes += self._pass_bytes
            state.streamed_bytes_last_pass = self._pass_bytes
            if self._pass_decode:
                compute_s = max(0.0, time.perf_counter() - self._pass_start_s
                                - self._pass_copy_s)
                state.decode_compute_s = compute_s if state.decode_passes == 0 else (
                    DECODE_EWMA * compute_s + (1 - DECODE_EWMA) * state.decode_compute_s)
                state.decode_passes += 1
        finally:
            self.lock.release()

    # sleep and wake (the sleeper calls these under `lock`)

    def before_sleep(self) -> None:
        """Give the slots back; the lent layers stay lent (their slabs are the arena's)."""
        self._unmap_lent()
        self._resize_slots(0)

    def after_wake(self) -> None:
        """The wake mapped and restored every layer: lend S again. Without room for the slots
        S stays empty (every layer resident: the runtime serves), and the state says why."""
        layers, self.state.layers = self.state.layers, []
        self._account()
        if layers:
            try:
                self.apply(StreamRequest(tuple(layers), self.state.slots, self.state.seq))
            except ArenaExhausted as exc:
                self.state.error = f"after the wake, layers {layers} stay resident: {exc}"
                logger.warning("fineslab: %s", self.state.error)
        self.publish()

    def publish(self) -> None:
        if self._state_file is not None:
            write_state(self._state_file, self.state)

    def close(self) -> None:
        self._host_mapping.close()


def install_hooks(streamer: LayerStreamer, model: torch.nn.Module) -> list[Any]:
    """Bracket each forward pass (the call of the module that holds the decoder layers) with the
    streamer's lock, and stream each layer before it runs. Returns the hook handles.
    SGLang's split prefill (`forward_split_prefill`, PD multiplexing on CUDA) calls the layers
    without that module, so a pass there is not bracketed: not supported with streaming."""
    owner = layers_owner(model)
    handles = [owner.register_forward_pre_hook(
                   lambda module, args, kwargs: streamer.begin_pass(is_decode(args, kwargs)),
                   with_kwargs=True),
               owner.register_forward_hook(lambda module, args, out: streamer.end_pass(),
                                           always_call=True)]  # also when the pass raises
    layers = decoder_layers(model)
    for index, decoder in layers.items():
        handles.append(decoder.register_forward_pre_hook(
            lambda module, args, index=index: streamer.before_layer(index)))
        handles.append(decoder.register_forward_hook(
            lambda module, args, out, index=index: streamer.after_layer(index)))
    return handles


class RequestWatcher:
    """A daemon thread that applies the runtime's stream request when it changes, and publishes
    the state after each change and whenever forward passes moved its counters (both within
    POLL_S; streamctl)."""

    def __init__(self, streamer: LayerStreamer, request_file: Path) -> None:
        self.streamer, self.request_file = streamer, request_file
        self._seen: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fineslab-stream-watch",
                                        daemon=True)

    def start(self) -> None:
        self.poll()  # a request written before start applies before the first pass
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        published = -1
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
                if self.streamer.state.passes != published:  # counters moved: publish them
                    with self.streamer.lock:
                        published = self.streamer.state.passes
                        self.streamer.publish()
            except Exception:  # the watcher must not die: the runtime serves on with S as is
                logger.exception("fineslab: layer streaming request %s", self.request_file)

    def poll(self) -> None:
        try:
            stat = self.request_file.stat()
        except FileNotFoundError:
            return
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return
        self._seen = seen
        streamer = self.streamer
        request: StreamRequest | None = None
        with streamer.lock:
            try:
                request = read_request(self.request_file)
                if request is not None and request.seq != streamer.state.seq:
                    start_s = time.perf_counter()
                    streamer.apply(request)
                    logger.info("fineslab: stream request %d applied in %.4f s", request.seq,
                                time.perf_counter() - start_s)
            except (ConfigError, ArenaExhausted) as exc:
                streamer.state.error = str(exc)
                if request is not None:
                    streamer.state.seq = request.seq
                logger.warning("fineslab: stream request refused: %s", exc)
            streamer.publish()


def start_streaming(join: Any, region: Any, spans: Sequence[LayerSpan], model: torch.nn.Module,
                    host_copy: Path) -> LayerStreamer:
    """The runtime's streamer, its hooks on `model`, and the watcher of its request (a request
    already written, e.g. by the launcher, applies before the first forward pass)."""
    from fineslab.slabs.streamctl import request_path, state_path

    streamer = LayerStreamer(region, spans, host_copy,
                             state_path(join.arena_name, join.runtime_id))
    install_hooks(streamer, model)
    RequestWatcher(streamer, request_path(join.arena_name, join.runtime_id)).start()
    streamer.publish()
    return streamer

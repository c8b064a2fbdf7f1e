"""Sleep and wake through SGLang's own API: the memory-saver adapter of a runtime in an arena.

SGLang's `POST /release_memory_occupation` and `/resume_memory_occupation` (tags `weights`,
`kv_cache`) end in `pause(tag)` / `resume(tag)` on the scheduler's memory-saver adapter, which
SGLang gets from `TorchMemorySaverAdapter.create` (CUDA's torch_memory_saver, or a no-op). The
plugin wraps that factory (an AROUND hook; a contact row) to return `ArenaMemorySaver` in every
process of a runtime that joins an arena, whatever `enable_memory_saver` says:

    pause("weights")    the weights' host copy is written once (a file in region layout), then
                        the weight slabs go back to the arena (`WeightRegion.unback`): FREE
                        in the table, still resident, so a neighbour or the wake reuses them
                        at memcpy speed
    resume("weights")   take free slabs (any), map them at the same addresses, copy the host
                        copy into them (`copy_file_into`: at memcpy speed)
    "kv_cache"          nothing: SGLang flushes the cache right after pause("kv_cache"), which
                        gives every KV page back to the arena through the SlabAllocator
    region("weights")   SGLang wraps its loader call in it: on CUDA the load runs inside the
                        runtime's arena region (`PluginSession.weights_load`, cuda_weights.py);
                        on CPU nothing (the weights are moved after loading)
    cuda_graph(), disable(), configure_subprocess(), other regions   no-ops

On CUDA the host copy, once written, stays pinned (`PinnedHostCopy`, page-locked until the
runtime ends): each wake is one DMA at the link's speed instead of pinning chunk by chunk
(0.97-1.0 of the link against 0.48, docs/elastic.md); it costs that much host memory locked.

What SGLang does around these calls, and what the caller must do (docs/elastic.md): release
asserts the scheduler is idle and the whole server dies when it is not, so release only after
`/pause_generation {"mode": "retract"}`; resume of a tag that was not released dies too
(KeyError); nothing stops generation while weights are released. The router's sleep and wake
follow that order.

    asleep:  the runtime holds 0 weight slabs and 0 KV pages; its host copy file exists
    awake:   weights bit-identical to before the sleep (the host copy is those bytes)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fineslab.errors import ArenaExhausted
from fineslab.slabs.weights import copy_file_into, write_host_copy

logger = logging.getLogger(__name__)

WEIGHTS_TAG = "weights"


#: Opens a host copy pinned: (path, nbytes) -> an object with `copy_into(dst)` and `close()`.
PinFactory = Callable[[Path, int], Any]


def pin_for(region: Any) -> PinFactory | None:
    """How the host copy of `region` is kept for wakes: pinned on CUDA (`PinnedHostCopy`), as a
    file in the page cache on CPU (None)."""
    if region.tensor().is_cuda:
        from fineslab.slabs.weights import PinnedHostCopy

        return PinnedHostCopy
    return None


class WeightSleeper:
    """Sleep and wake of one runtime's `WeightRegion`, with its host copy.

    With `pin` the host copy is pinned once written (the first sleep, or already by the
    streamer: `pinned`) and every wake copies from that pinned copy, never from the file again:

        pinned is None  <=>  no pin, or the host copy not written yet
    """

    def __init__(self, region: Any, path: Path, host_copy_written: bool = False,
                 pin: PinFactory | None = None, pinned: Any = None) -> None:
        self.region, self.path = region, path
        self._written = host_copy_written
        self._pin = pin
        self.pinned: Any = pinned

    @property
    def asleep(self) -> bool:
        return not self.region.backed

    def sleep(self) -> float:
        """Give the weight slabs back; returns the seconds it took."""
        if self.asleep:
            return 0.0
        start_s = time.perf_counter()
        if not self._written:
            write_host_copy(self.region, self.path)
            self._written = True
        if self._pin is not None and self.pinned is None:
            self.pinned = self._pin(self.path, self.region.nbytes)
        num_slabs = self.region.num_slabs
        self.region.unback()
        took_s = time.perf_counter() - start_s
        logger.info("fineslab: weights of %r asleep: %d slab(s) back to the arena in %.3f s",
                    self.region.runtime_id, num_slabs, took_s)
        return took_s

    def wake(self) -> float:
        """Take slabs and restore the weights; returns the seconds it took. Raises
        ArenaExhausted (still asleep) when the arena has too few free slabs."""
        if not self.asleep:
            return 0.0
        start_s = time.perf_counter()
        self.region.back()
        try:
            if self.pinned is not None:
                self.pinned.copy_into(self.region.tensor())
            else:
                copy_file_into(self.path, self.region.tensor())
        except OSError:
            self.region.unback()
            raise
        took_s = time.perf_counter() - start_s
        logger.info("fineslab: weights of %r awake: %d slab(s), %.1f MiB in %.5f s",
                    self.region.runtime_id, self.region.num_slabs,
                    self.region.nbytes / 2**20, took_s)
        return took_s

    def close(self) -> None:
        """Unpin the host copy (the runtime ends)."""
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None


class ArenaMemorySaver:
    """SGLang's memory-saver adapter interface, over the session's weights (module doc)."""

    enabled = False  # read by SGLang's CUDA graph backends only

    def __init__(self, session: Any) -> None:
        self._session = session

    @contextlib.contextmanager
    def region(self, tag: str | None = None, enable_cpu_backup: bool = False) -> Iterator[None]:
        if tag == WEIGHTS_TAG:
            with self._session.weights_load():
                yield
        else:
            yield

    @contextlib.contextmanager
    def cuda_graph(self, **kwargs: Any) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def configure_subprocess(self) -> Iterator[None]:
        yield

    def check_validity(self, caller_name: str) -> None:
        return None

    def pause(self, tag: str) -> None:
        sleeper, streamer = self._session.sleeper, self._session.streamer
        if tag == WEIGHTS_TAG and sleeper is not None:
            with streamer.lock if streamer is not None else contextlib.nullcontext():
                if streamer is not None:
                    streamer.before_sleep()  # slots back; lent layers stay lent
                sleeper.sleep()

    def resume(self, tag: str) -> None:
        sleeper, streamer = self._session.sleeper, self._session.streamer
        if tag == WEIGHTS_TAG and sleeper is not None:
            try:
                with streamer.lock if streamer is not None else contextlib.nullcontext():
                    sleeper.wake()
                    if streamer is not None:
                        streamer.after_wake()  # every layer restored: lend S again
            except ArenaExhausted:
                # SGLang has no way to refuse a resume: running on with unmapped weights would
                # fault at the first step. Stop here, loudly; the supervisor restarts it.
                logger.exception("fineslab: no room in the arena to wake %r; the runtime stops "
                                 "(make room before waking it)", sleeper.region.runtime_id)
                raise

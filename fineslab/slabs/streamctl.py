"""Telling a runtime which layers to stream, and reading what it did (issue #17).

A runtime started with `FINESLAB_LAYER_STREAMING=1` watches one small JSON file, its request,
and answers in another, its state; both sit beside its weights' host copy
(`$FINESLAB_WEIGHTS_DIR` or the temp folder):

    fineslab-<arena>-<runtime>.stream        {"layers": [3, 7], "slots": 1}   (the caller's)
    fineslab-<arena>-<runtime>.stream-state  what the runtime applied (`StreamState`)

S (the layers whose weights are lent to the arena and streamed back before they run) changes
only between forward passes: the runtime's watcher checks the request every POLL_S, and
applies it when no forward pass is running (it waits for the one in flight). Both files are
written whole and renamed into place, so a reader never sees half of one. The launcher, the
router's policies and the tests write requests with `write_request`; `read_state` tells them
when it took effect (`seq` echoes the request's).

    request seq == state seq  <=>  the runtime applied that request (or refused it: `error`)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fineslab.env import WEIGHTS_DIR_VAR
from fineslab.errors import ConfigError
from fineslab.jsonfile import write_json_whole

#: How often a runtime looks at its request (seconds): a change waits at most this long.
POLL_S = 0.05
#: Slot buffers: 1 (streamed layers take turns in one) or 2 (one prefetched while one runs).
SLOT_CHOICES = (1, 2)


def host_copy_path(arena_name: str, runtime_id: str, folder: Path | None = None) -> Path:
    """Where a runtime's weights wait while it sleeps, and whence streamed layers are read:
    `folder`, else the runtime's $FINESLAB_WEIGHTS_DIR (the launcher gives each fleet one, and
    removes it at stop), else the temp folder."""
    folder = folder or Path(os.environ.get(WEIGHTS_DIR_VAR) or tempfile.gettempdir())
    return folder / f"fineslab-{arena_name}-{runtime_id}.weights"


def request_path(arena_name: str, runtime_id: str, folder: Path | None = None) -> Path:
    return host_copy_path(arena_name, runtime_id, folder).with_suffix(".stream")


def state_path(arena_name: str, runtime_id: str, folder: Path | None = None) -> Path:
    return host_copy_path(arena_name, runtime_id, folder).with_suffix(".stream-state")


@dataclass(frozen=True)
class StreamRequest:
    """Which layers to stream, through how many slot buffers."""

    layers: tuple[int, ...]
    slots: int = 1
    seq: int = 0

    def __post_init__(self) -> None:
        if self.slots not in SLOT_CHOICES:
            raise ConfigError(f"slots {self.slots}: expected one of {SLOT_CHOICES}")
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.layers):
            raise ConfigError(f"layers {list(self.layers)}: expected layer indexes >= 0")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"layers {list(self.layers)}: an index is repeated")

    def check_against(self, num_layers: int) -> None:
        """ConfigError unless every layer exists and at least one stays resident (a model with
        every layer streamed would copy its whole weights each forward pass)."""
        outside = [i for i in self.layers if i >= num_layers]
        if outside:
            raise ConfigError(f"layers {outside} do not exist: the model has {num_layers}")
        if len(self.layers) >= num_layers:
            raise ConfigError(f"all {num_layers} layers streamed: at least one stays resident")


@dataclass
class StreamState:
    """What a runtime applied, written after each change and each forward pass that streamed."""

    seq: int = -1
    layers: list[int] = field(default_factory=list)
    slots: int = 1
    #: weight bytes given to the arena (the lent layers' slabs) and taken back for slots
    lent_bytes: int = 0
    slot_bytes: int = 0
    #: bytes copied from the host copy: in all, and in the last forward pass
    streamed_bytes: int = 0
    streamed_bytes_last_pass: int = 0
    #: seconds spent copying streamed layers in (synchronous on CPU)
    copy_seconds: float = 0.0
    passes: int = 0
    error: str | None = None
    #: the model's decoder layers, and the bytes one lent layer frees (the widest layer's slabs)
    num_layers: int = 0
    layer_bytes: int = 0
    #: a decode pass's compute (its wall time less the copies in it): a moving average over
    #: the `decode_passes` timed so far (Oneiros' T_compute of an active model's step)
    decode_compute_s: float = 0.0
    decode_passes: int = 0

    def layer_copy_s(self) -> float | None:
        """Seconds to stream one layer in, as measured so far (None before any copy)."""
        if self.streamed_bytes <= 0 or self.copy_seconds <= 0:
            return None
        return self.layer_bytes * self.copy_seconds / self.streamed_bytes

    @property
    def net_lent_bytes(self) -> int:
        """What the arena gained: lent layers less the slot buffers."""
        return self.lent_bytes - self.slot_bytes


def write_request(arena_name: str, runtime_id: str, layers: list[int] | tuple[int, ...],
                  slots: int = 1, folder: Path | None = None) -> StreamRequest:
    """Ask the runtime to stream `layers`; returns the request (its seq is one past the last)."""
    path = request_path(arena_name, runtime_id, folder)
    try:
        previous = read_request(path)
    except ConfigError:  # a malformed request is replaced
        previous = None
    state = read_state(arena_name, runtime_id, folder)
    seq = 1 + max(-1, previous.seq if previous else -1, state.seq if state else -1)
    request = StreamRequest(tuple(sorted(layers)), slots, seq)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_whole(path, asdict(request))
    return request


def apply_request(arena_name: str, runtime_id: str, layers: list[int] | tuple[int, ...],
                  slots: int = 1, timeout_s: float = 60.0, poll_s: float = 0.02,
                  folder: Path | None = None) -> StreamState:
    """`write_request`, then wait until the runtime applied it (its state's seq is the
    request's); RuntimeError when it refused it (`error`) or did not apply it in `timeout_s`."""
    request = write_request(arena_name, runtime_id, layers, slots, folder)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(arena_name, runtime_id, folder)
        if state is not None and state.seq == request.seq:
            if state.error:
                raise RuntimeError(f"stream request {list(layers)} refused: {state.error}")
            return state
        time.sleep(poll_s)
    raise RuntimeError(f"the runtime did not apply stream request {list(layers)} in "
                       f"{timeout_s:g} s")


def read_request(path: Path) -> StreamRequest | None:
    """The request at `path`, None if there is none; ConfigError if it is malformed."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"stream request {path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list):
        raise ConfigError(f"stream request {path}: expected {{\"layers\": [...]}}")
    try:
        return StreamRequest(tuple(doc["layers"]), int(doc.get("slots", 1)),
                             int(doc.get("seq", 0)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"stream request {path}: {exc}") from exc


def write_state(path: Path, state: StreamState) -> None:
    write_json_whole(path, asdict(state))


def read_state(arena_name: str, runtime_id: str, folder: Path | None = None
               ) -> StreamState | None:
    """The runtime's last state, None before it wrote one (or while it is unreadable)."""
    try:
        doc = json.loads(state_path(arena_name, runtime_id, folder).read_text())
    except (OSError, ValueError):
        return None
    known = {f.name for f in fields(StreamState)}
    return StreamState(**{k: v for k, v in doc.items() if k in known})  # a newer writer's extras

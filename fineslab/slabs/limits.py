"""KV limits in the slab table: an operator's cap on the KV bytes one runtime id may hold.

A limit is kept by runtime id in the limit rows (so a restarted runtime keeps it, and one may
be set before its runtime starts) and copied into the registry slot at register and at every
change. Enforced where memory is drawn: private runtimes, slabs held * slab_bytes <= limit at
carve (table.py); key-pool runtimes, blocks held * key <= limit (pooled.py). Weight slabs
(owner `<runtime>:w`) are not KV and have no limit. Lowering a limit below what a runtime holds
takes nothing back: it only refuses new slabs until use drops. `SlabTable` mixes this in;
the fields of the table file it uses, one row per registry slot or limit row:

    rt_limited, rt_limit   the registry slot's copy of its runtime's limit (read per carve)
    lim_set, lim_bytes,    the limits by runtime id, kept across restarts of that runtime
    lim_name

Invariant: an active slot whose runtime id has a set row has rt_limited == 1 and rt_limit ==
that row's bytes; every other active slot has rt_limited == 0. Changes happen under the table
lock; reads are lock-free (a field of a few bytes, read per carve and per available_blocks).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from fineslab.errors import ConfigError

RUNTIME_ID_BYTES = 64
#: The largest limit the table holds (an int64 field); a larger one is no limit a machine has.
MAX_KV_LIMIT = (1 << 63) - 1


def id_bytes(runtime_id: str) -> bytes:
    """A runtime id as stored in the table; ConfigError when empty or too long."""
    name = runtime_id.encode()
    if not name or len(name) > RUNTIME_ID_BYTES:
        raise ConfigError(f"runtime id {runtime_id!r} must be 1-{RUNTIME_ID_BYTES} bytes")
    return name


class _Rows(Protocol):
    """The one size the limit rows need of the table's (`table.TableDims` is one)."""

    @property
    def max_runtimes(self) -> int: ...


class KVLimitRows:
    """The KV limit operations of `SlabTable` (which provides the fields and the lock)."""

    dims: _Rows
    rt_limited: np.ndarray
    rt_limit: np.ndarray
    lim_set: np.ndarray
    lim_bytes: np.ndarray
    lim_name: np.ndarray

    def lock(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def active_runtimes(self) -> dict[int, str]:
        raise NotImplementedError

    def set_kv_limit(self, runtime_id: str, limit_bytes: int | None) -> None:
        """Cap the KV bytes `runtime_id` may hold (None: no cap), now and after its restarts."""
        name = id_bytes(runtime_id)
        if limit_bytes is not None and not 0 <= limit_bytes <= MAX_KV_LIMIT:
            raise ConfigError(f"KV limit of {runtime_id!r} must be 0 to {MAX_KV_LIMIT} bytes, "
                              f"not {limit_bytes}")
        with self.lock():
            row = self._limit_row(name)
            if limit_bytes is None:
                if row is not None:
                    self.lim_set[row], self.lim_bytes[row], self.lim_name[row] = 0, 0, 0
                    row = None
            else:
                if row is None:
                    free = np.flatnonzero(self.lim_set == 0)
                    if free.size == 0:
                        raise ConfigError(f"all {self.dims.max_runtimes} KV limit rows are taken")
                    row = int(free[0])
                    self.lim_name[row] = 0
                    self.lim_name[row, : len(name)] = np.frombuffer(name, np.uint8)
                self.lim_bytes[row], self.lim_set[row] = limit_bytes, 1
            for slot, active_id in self.active_runtimes().items():
                if active_id == runtime_id:
                    self._apply_limit_locked(slot, row)

    def kv_limit(self, slot: int) -> int | None:
        """The KV limit of registry `slot` in bytes, None when uncapped (lock-free read)."""
        return int(self.rt_limit[slot]) if self.rt_limited[slot] else None

    def kv_limits(self) -> dict[str, int]:
        """Runtime id -> KV limit in bytes, for every limit set (lock-free read)."""
        return {self.lim_name[row].tobytes().rstrip(b"\0").decode(): int(self.lim_bytes[row])
                for row in np.flatnonzero(self.lim_set == 1)}

    def _limit_row(self, name: bytes) -> int | None:
        padded = np.frombuffer(name.ljust(RUNTIME_ID_BYTES, b"\0"), np.uint8)
        rows = np.flatnonzero((self.lim_set == 1) & (self.lim_name == padded).all(axis=1))
        return int(rows[0]) if rows.size else None

    def _apply_limit_locked(self, slot: int, row: int | None) -> None:
        self.rt_limit[slot] = self.lim_bytes[row] if row is not None else 0
        self.rt_limited[slot] = int(row is not None)

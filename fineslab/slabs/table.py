"""The slab table: which slab holds which block size, for whom, and which of its blocks are free.

It lives in one shared-memory file per device (shm.py) so that every runtime on the device, the
launcher and the router see the same table; numpy views over the mapping make it fast to scan.

Glossary
    slab        slab_bytes of the arena at offset slab_id * slab_bytes, holding blocks of one
                size only. Slab states: FREE (in the free space), PARTIAL, FULL.
    key         the block stride in bytes a slab is formatted to (0 while FREE).
    owner       the registry slot of the runtime that holds the slab (NO_OWNER while FREE), or
                POOLED for a slab of a key pool (below).
    key pool    the paper's "compatible models share a slab pool": runtimes registered `pooled`
                share the slabs of their key; any of them takes free blocks of any POOLED slab
                of its key. Each block of a POOLED slab records its runtime in `block_owner`
                (slot + 1; 0 = free), so a free of another runtime's block is refused and a dead
                runtime's blocks are reclaimed one by one. Operations live in `pooled.py`.
    bps         blocks per slab = slab_bytes // key.
    free map    one byte per block slot of a slab: 1 = free, 0 = in use or beyond bps (a byte, not a
                bit, so numpy scans and sets it without bit twiddling; 8x a bitmap's size, 5 MB
                for an 80 GB arena of 64 MiB slabs at 4,096 blocks per slab).
    block_owner one byte per block slot of a slab: slot + 1 of the runtime holding the block in a
                POOLED slab, 0 otherwise (free, beyond bps, or a private slab's block).
    registry    max_runtimes slots: runtime id, (pid, start ticks), key, pooled, status
                FREE/ACTIVE, and its KV limit (below).
    KV limit    an operator's cap on one runtime id's KV bytes (`fineslab ctl limit`; limits.py)
    lent slab   a FREE slab holding a borrower's evicted prefix pages (SwiftCache, `lent.py`):
                lent_to = its slot + 1. It stays FREE, so every reader counts it as free and
                every carve may take it (unlent slabs first); lent_gen changes whenever a carve
                takes it or its mark is cleared, which is how the borrower learns its pages
                are gone. lent_busy: 1 while the borrower copies pages in, without the lock; a
                carve that must take such a slab waits for the copy (one slab's bytes).
                rt_lend_cap: the slabs a runtime may hold lent (0: none; the launcher's lending
                round sets it)
    pool squeeze a header counter a key-pool runtime moves (under the lock) when its pool and
                the free space came up short: every pooled runtime gives the blocks it caches
                back at its next call (pool_cache.py; advisory, so it is the one word a refused
                pooled allocation changes)
    cache squeeze a header counter (and the free slabs wanted) a runtime moves, without the
                lock, when a request of its own was short of free slabs: every runtime that sees
                it move evicts unreferenced prefix cache until that many slabs are free
                (sglang_plugin/cache_squeeze.py; advisory)

Invariants (check_integrity verifies each; T3 and T4 only for owners that are quiescent)
    T1  state[s] == FREE  <=>  owner[s] == NO_OWNER
        state[s] == FREE  =>  key[s] == used[s] == 0,  free_map[s] == 0
    T2  state[s] != FREE  =>  registry[owner[s]] ACTIVE,  key[s] == its registry key,
                              slab_bytes % key[s] == 0
    T3  state[s] != FREE  =>  used[s] + sum(free_map[s, :bps]) == bps,  free_map[s, bps:] == 0
    T4  state[s] != FREE  =>  0 < used[s] <= bps,  state[s] == FULL <=> used[s] == bps
        (an empty slab goes back to the free space at once)
    T5  active runtime ids are unique; header.lock_holder == 0 whenever the lock is free
    T6  owner[s] == POOLED  =>  for j < bps: free_map[s, j] == 1  <=>  block_owner[s, j] == 0,
                                block_owner[s, j] - 1 is an ACTIVE pooled runtime of key[s],
                                block_owner[s, bps:] == 0
        owner[s] != POOLED  =>  block_owner[s] == 0
    T7  lent_to[s] != 0  =>  state[s] == FREE,  registry[lent_to[s] - 1] ACTIVE
        lent_busy[s] == 1  =>  lent_to[s] != 0
    free_bytes + slab_bytes * #{s: state[s] != FREE} == num_slabs * slab_bytes

Ownership and locking
    One lock: an exclusive flock on the table file (released by the kernel if its holder dies).
    No other lock exists, so there is no lock order to respect; never hold it while calling out.
    Under the lock only: carve (FREE -> owned), release (owned -> FREE), register/unregister,
    reclaim of dead owners, every change to a POOLED slab, every lent mark, generation and
    cap, and a borrower's copy into a lent slab (lent.py). Without the lock: the owner of a
    private slab, and only it, changes that slab's used count, free map and PARTIAL/FULL state
    (RuntimeSlabs' fast path). So under the
    lock every FREE slab and every owner/key field is stable; the block counts of another
    runtime's slabs are a best-effort view (exact once that runtime is quiescent).
    Crash safety: the lock holder writes its pid into the header; a process that takes the lock
    and finds a pid there knows the holder died mid-update and repairs the table first.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineslab.errors import ArenaExhausted, ConfigError, EnvironmentSetupError, IntegrityError
from fineslab.proctree import ProcessIdentity
from fineslab.slabs.limits import RUNTIME_ID_BYTES, KVLimitRows, id_bytes
from fineslab.slabs.shm import create_file, map_fd, open_file

logger = logging.getLogger(__name__)

MAGIC = 0x3142_5441_4C53_4946  # "FISLATB1" little-endian
VERSION = 4  # 2: key pools (block_owner, rt_pooled); 3: KV limits; 4: lent slabs (lent.py)
NO_OWNER = -1
POOLED = -2
#: Slab 0 holds slot 0 of every format, where SGLang writes its padded tokens, so it only ever
#: holds KV, parked whole by the runtime that draws from it first (sglang_plugin/allocator.py).
PADDING_SLAB = 0
#: Weights are carved from this slab on: padded writes would land in a model's weights, and a
#: model whose weights leave slab 0 when it sleeps would hand the arena a slab that a KV runtime
#: then parks whole, one slab fewer for the KV the eviction made room for (the restart test
#: found it).
FIRST_WEIGHT_SLAB = PADDING_SLAB + 1
HANDLE_CAPACITY_BYTES = 4096
#: The longest a carve waits for a borrower's copy into a lent slab it must take (lent.py).
BUSY_WAIT_S = 1.0
_READY_TIMEOUT_S = 5.0


class SlabState(enum.IntEnum):
    FREE = 0
    PARTIAL = 1
    FULL = 2


class _Hdr(enum.IntEnum):
    """Word indices of the int64 header."""

    MAGIC = 0
    VERSION = 1
    NUM_SLABS = 2
    SLAB_BYTES = 3
    MAX_BLOCKS_PER_SLAB = 4
    MAX_RUNTIMES = 5
    CREATOR_PID = 6
    CREATOR_START = 7
    LOCK_HOLDER = 8
    BACKING = 9
    HANDLE_LEN = 10
    READY = 11
    SLAB_EPOCH = 12  # +1 whenever a slab changes owner or key (carve, free): see slab_epoch
    POOL_SQUEEZE = 13  # +1 when a key-pool runtime came up short: see pool_squeeze
    CACHE_SQUEEZE = 14  # +1 when a runtime's request was short of free slabs: cache_squeeze
    CACHE_WANT = 15  # the free slabs that request wanted: cache_squeeze


_HEADER_WORDS = 16


@dataclass(frozen=True)
class TableDims:
    """The sizes a table is created with; they fix its file layout."""

    num_slabs: int
    slab_bytes: int
    max_blocks_per_slab: int
    max_runtimes: int = 64

    def __post_init__(self) -> None:
        for name in ("num_slabs", "slab_bytes", "max_blocks_per_slab", "max_runtimes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"slab table: {name} must be positive")
        if self.max_runtimes > 255:
            raise ConfigError("slab table: at most 255 runtimes (block_owner is one byte)")

    def fields(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        n, m, r = self.num_slabs, self.max_blocks_per_slab, self.max_runtimes
        return [
            ("header", np.dtype(np.int64), (_HEADER_WORDS,)),
            ("handle", np.dtype(np.uint8), (HANDLE_CAPACITY_BYTES,)),
            ("state", np.dtype(np.uint8), (n,)),
            ("key", np.dtype(np.int64), (n,)),
            ("owner", np.dtype(np.int32), (n,)),
            ("used", np.dtype(np.int32), (n,)),
            ("free_map", np.dtype(np.uint8), (n, m)),
            ("block_owner", np.dtype(np.uint8), (n, m)),
            ("lent_to", np.dtype(np.uint8), (n,)),
            ("lent_gen", np.dtype(np.int64), (n,)),
            ("lent_busy", np.dtype(np.uint8), (n,)),
            ("rt_status", np.dtype(np.uint8), (r,)),
            ("rt_pid", np.dtype(np.int64), (r,)),
            ("rt_start", np.dtype(np.int64), (r,)),
            ("rt_key", np.dtype(np.int64), (r,)),
            ("rt_pooled", np.dtype(np.uint8), (r,)),
            ("rt_name", np.dtype(np.uint8), (r, RUNTIME_ID_BYTES)),
            ("rt_limited", np.dtype(np.uint8), (r,)),
            ("rt_limit", np.dtype(np.int64), (r,)),
            ("lim_set", np.dtype(np.uint8), (r,)),
            ("lim_bytes", np.dtype(np.int64), (r,)),
            ("lim_name", np.dtype(np.uint8), (r, RUNTIME_ID_BYTES)),
            ("rt_lend_cap", np.dtype(np.int32), (r,)),
        ]

    def offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of every field (64-byte aligned) and the file size."""
        offsets, cursor = {}, 0
        for name, dtype, shape in self.fields():
            offsets[name] = cursor
            cursor += -(-dtype.itemsize * int(np.prod(shape)) // 64) * 64
        return offsets, cursor


class _TableLock:
    """`with table.lock():` (a class, not a generator context manager: the key pools take the
    lock on every allocation and free, and a generator costs microseconds there)."""

    __slots__ = ("_table",)

    def __init__(self, table: SlabTable) -> None:
        self._table = table

    def __enter__(self) -> None:
        self._table._acquire()

    def __exit__(self, *exc: object) -> None:
        self._table._release()


class SlabTable(KVLimitRows):
    """The shared slab table of one device. Use `create` (launcher) or `open` (everyone else)."""

    dims: TableDims

    def __init__(self, path: Path, fd: int, dims: TableDims, writable: bool) -> None:
        offsets, size = dims.offsets()
        self.path, self.dims, self.writable = path, dims, writable
        self._fd = fd
        self._mm = map_fd(fd, size, writable)
        views = {name: np.frombuffer(self._mm, dtype, int(np.prod(shape)), offsets[name])
                 .reshape(shape) for name, dtype, shape in dims.fields()}
        self.header, self.handle = views["header"], views["handle"]
        self.state, self.key, self.owner = views["state"], views["key"], views["owner"]
        self.used, self.free_map = views["used"], views["free_map"]
        self.block_owner, self.rt_pooled = views["block_owner"], views["rt_pooled"]
        self.rt_status, self.rt_pid = views["rt_status"], views["rt_pid"]
        self.rt_start, self.rt_key, self.rt_name = (
            views["rt_start"], views["rt_key"], views["rt_name"])
        self.rt_limited, self.rt_limit = views["rt_limited"], views["rt_limit"]
        self.lim_set, self.lim_bytes, self.lim_name = (
            views["lim_set"], views["lim_bytes"], views["lim_name"])
        self.lent_to, self.lent_gen = views["lent_to"], views["lent_gen"]
        self.lent_busy = views["lent_busy"]
        self.rt_lend_cap = views["rt_lend_cap"]
        self.me = ProcessIdentity.current()
        self._repaired_ids: list[str] = []  # runtimes dropped by a repair, for reclaim's report
        self._lock = _TableLock(self)
        self._thread_lock = threading.RLock()
        self._depth = 0  # nesting of `lock()` in the thread that holds it

    # -- create / open / close ------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, dims: TableDims, backing: int, handle: bytes = b"") -> SlabTable:
        """Create the file (FileExistsError if present); returns the table, marked ready."""
        if len(handle) > HANDLE_CAPACITY_BYTES:
            raise ConfigError(f"arena handle of {len(handle)} B exceeds the table's capacity")
        fd = create_file(path, dims.offsets()[1])
        table = cls(path, fd, dims, writable=True)
        hdr = table.header
        hdr[_Hdr.VERSION], hdr[_Hdr.NUM_SLABS] = VERSION, dims.num_slabs
        hdr[_Hdr.SLAB_BYTES], hdr[_Hdr.MAX_BLOCKS_PER_SLAB] = (
            dims.slab_bytes, dims.max_blocks_per_slab)
        hdr[_Hdr.MAX_RUNTIMES], hdr[_Hdr.BACKING] = dims.max_runtimes, backing
        hdr[_Hdr.CREATOR_PID], hdr[_Hdr.CREATOR_START] = table.me.pid, table.me.start_ticks
        table.owner[:] = NO_OWNER
        table.handle[: len(handle)] = np.frombuffer(handle, np.uint8)
        hdr[_Hdr.HANDLE_LEN] = len(handle)
        hdr[_Hdr.MAGIC] = MAGIC
        hdr[_Hdr.READY] = 1
        return table

    @classmethod
    def open(cls, path: Path, writable: bool = True) -> SlabTable:
        """Open an existing table; waits up to 5 s for a creator still initializing it."""
        try:
            fd = open_file(path, writable)
        except FileNotFoundError:
            raise EnvironmentSetupError(f"no slab table at {path}: is the launcher running?"
                                        ) from None
        header = read_header(fd)
        dims = TableDims(int(header[_Hdr.NUM_SLABS]), int(header[_Hdr.SLAB_BYTES]),
                         int(header[_Hdr.MAX_BLOCKS_PER_SLAB]), int(header[_Hdr.MAX_RUNTIMES]))
        return cls(path, fd, dims, writable)

    def close(self) -> None:
        for name in ("header", "handle", "state", "key", "owner", "used", "free_map",
                     "block_owner", "rt_status", "rt_pid", "rt_start", "rt_key", "rt_pooled",
                     "rt_name", "rt_limited", "rt_limit", "lim_set", "lim_bytes", "lim_name",
                     "lent_to", "lent_gen", "lent_busy", "rt_lend_cap"):
            setattr(self, name, None)
        try:
            self._mm.close()
        except BufferError:
            logger.debug("slab table %s: views still alive; the mapping closes with them",
                         self.path)
        os.close(self._fd)

    @property
    def creator(self) -> ProcessIdentity:
        return ProcessIdentity(int(self.header[_Hdr.CREATOR_PID]),
                               int(self.header[_Hdr.CREATOR_START]))

    @property
    def backing(self) -> int:
        return int(self.header[_Hdr.BACKING])

    def raw(self) -> bytes:
        """A copy of the whole table file (tests compare it before and after a refused call)."""
        return bytes(self._mm)

    @property
    def lock_holder_pid(self) -> int:
        return int(self.header[_Hdr.LOCK_HOLDER])

    def handle_bytes(self) -> bytes:
        return self.handle[: int(self.header[_Hdr.HANDLE_LEN])].tobytes()

    @property
    def slab_epoch(self) -> int:
        """A counter that changes whenever any slab changes owner or key. A reader that saw
        the same epoch under the lock before knows which slabs each owner and key has without
        scanning the table again (`PooledSlabs` caches its key pool's slabs by it)."""
        return int(self.header[_Hdr.SLAB_EPOCH])

    @property
    def pool_squeeze(self) -> int:
        """A counter that moves whenever a key-pool runtime came up short; a pooled runtime
        that sees it move gives the blocks it caches back to the pool (pool_cache.py)."""
        return int(self.header[_Hdr.POOL_SQUEEZE])

    def squeeze_pools_locked(self) -> int:
        """Ask every pooled runtime to give its cached blocks back (the caller holds the
        lock); returns the counter's new value."""
        self.header[_Hdr.POOL_SQUEEZE] += 1
        return int(self.header[_Hdr.POOL_SQUEEZE])

    @property
    def cache_squeeze(self) -> tuple[int, int]:
        """(counter, wanted free slabs): the counter moves whenever a runtime's request was
        short of free slabs that its own cap allowed; every runtime that sees it move evicts
        its unreferenced prefix cache until that many slabs are free (`squeeze_caches`)."""
        return int(self.header[_Hdr.CACHE_SQUEEZE]), int(self.header[_Hdr.CACHE_WANT])

    def squeeze_caches(self, wanted_slabs: int) -> int:
        """Ask every runtime to give back the prefix cache that holds `wanted_slabs` slabs;
        returns the counter's new value. Without the lock: advisory, like the pool squeeze.
        Two posts that race write the same value, which still differs from what each reader
        saw before; the wanted count is the last poster's."""
        self.header[_Hdr.CACHE_WANT] = max(1, wanted_slabs)
        value = int(self.header[_Hdr.CACHE_SQUEEZE]) + 1
        self.header[_Hdr.CACHE_SQUEEZE] = value
        return value

    def free_slab_count(self, but_padding: bool = True) -> int:
        """FREE slabs now (lock-free, so a best-effort view), without the padding slab unless
        asked: whoever draws it first parks it whole (sglang_plugin/allocator.py)."""
        free = int(np.count_nonzero(self.state == SlabState.FREE))
        return free - int(but_padding and self.state[PADDING_SLAB] == SlabState.FREE)

    # -- the lock -------------------------------------------------------------------------------
    def lock(self) -> _TableLock:
        """Hold the table lock (`with table.lock():`); repairs the table first if the previous
        holder died in it."""
        return self._lock

    def _acquire(self) -> None:
        # flock excludes other open files of the table, not other threads of this process
        # sharing this object (the launcher's reclaimer, elastic manager and ctl handlers):
        # the thread lock does that, and keeps a second thread from taking the first one's
        # LOCK_HOLDER mark for a holder that died. Reentrant: a nested `with table.lock()`
        # in one thread holds the file lock until the outermost one ends.
        self._thread_lock.acquire()
        self._depth += 1
        if self._depth > 1:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._depth -= 1
            self._thread_lock.release()
            raise
        if self.writable:
            try:
                holder = int(self.header[_Hdr.LOCK_HOLDER])
                if holder:
                    logger.warning("slab table %s: pid %d died holding the lock; repairing",
                                   self.path, holder)
                    self._repaired_ids = self._repair_locked()
                self.header[_Hdr.LOCK_HOLDER] = self.me.pid
            except BaseException:
                self._release()
                raise

    def _release(self) -> None:
        self._depth -= 1
        try:
            if self._depth == 0:
                if self.writable:
                    self.header[_Hdr.LOCK_HOLDER] = 0
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    # -- registry (under the lock) --------------------------------------------------------------
    def register(self, runtime_id: str, key: int, pooled: bool = False) -> int:
        """Give `runtime_id` a registry slot for blocks of stride `key`; returns the slot.

        `pooled`: the runtime allocates from its key's pool (POOLED slabs, see pooled.py)
        instead of slabs of its own.

        A dead runtime of the same id is reclaimed first; a live one is refused (ConfigError).
        """
        name = id_bytes(runtime_id)
        if key <= 0 or self.dims.slab_bytes % key or self.dims.slab_bytes // key > \
                self.dims.max_blocks_per_slab:
            raise ConfigError(
                f"block stride {key} B does not fit slab {self.dims.slab_bytes} B with at most "
                f"{self.dims.max_blocks_per_slab} blocks per slab")
        with self.lock():
            self._reclaim_dead_locked()
            if runtime_id in self.active_runtimes().values():
                raise ConfigError(f"runtime id {runtime_id!r} is attached by a live process")
            free_slots = np.flatnonzero(self.rt_status == 0)
            if free_slots.size == 0:
                raise ConfigError(f"all {self.dims.max_runtimes} runtime slots are taken")
            slot = int(free_slots[0])
            self.rt_name[slot] = 0
            self.rt_name[slot, : len(name)] = np.frombuffer(name, np.uint8)
            self.rt_pid[slot], self.rt_start[slot] = self.me.pid, self.me.start_ticks
            self.rt_key[slot], self.rt_pooled[slot] = key, int(pooled)
            self._apply_limit_locked(slot, self._limit_row(name))
            self.rt_status[slot] = 1
        return slot

    def unregister(self, slot: int) -> None:
        """Free `slot` and every slab it still holds (its blocks die with it)."""
        with self.lock():
            self._drop_runtime_locked(slot)

    def active_runtimes(self) -> dict[int, str]:
        """Registry slot -> runtime id of every active runtime (lock-free read)."""
        return {int(slot): self.rt_name[slot].tobytes().rstrip(b"\0").decode()
                for slot in np.flatnonzero(self.rt_status == 1)}

    def identity_of(self, slot: int) -> ProcessIdentity:
        return ProcessIdentity(int(self.rt_pid[slot]), int(self.rt_start[slot]))

    # -- carve / release (under the lock) -------------------------------------------------------
    def carve(self, slot: int, num_slabs: int) -> np.ndarray:
        """Take `num_slabs` FREE slabs (lowest ids) for `slot`, formatted PARTIAL and all free.

        Reclaims dead owners before giving up; raises ArenaExhausted (nothing changed) if short.
        """
        with self.lock():
            return self.carve_locked(slot, num_slabs, slot)

    def carve_locked(self, slot: int, num_slabs: int, owner: int,
                     lowest: int = 0) -> np.ndarray:
        """`carve` for a caller holding the lock; `owner` is `slot` or POOLED. Only slabs
        from `lowest` on (weights pass FIRST_WEIGHT_SLAB). Unlent FREE slabs first, then lent
        ones, whose pages are dropped (never moved: `lent.py`), lowest ids first in each."""
        free = self._carvable_locked(lowest)
        if free.size < num_slabs and self._reclaim_dead_locked():
            free = self._carvable_locked(lowest)
        if free.size < num_slabs:
            raise ArenaExhausted(
                f"{num_slabs} slab(s) wanted, {free.size} free of {self.dims.num_slabs}"
                + (f" from slab {lowest} on" if lowest else ""))
        limit = self.kv_limit(slot)
        if limit is not None and owner != POOLED:
            # The padding slab holds no KV the runtime can use: it is not counted.
            held = int(np.count_nonzero(self.owner == slot)) - int(self.owner[PADDING_SLAB] == slot)
            if (held + num_slabs) * self.dims.slab_bytes > limit:
                raise ArenaExhausted(
                    f"{num_slabs} slab(s) wanted beyond the KV limit of {limit} B "
                    f"({held} slab(s) of {self.dims.slab_bytes} B held)")
        chosen = free[:num_slabs]
        self._wait_copies_locked(chosen)
        key = int(self.rt_key[slot])
        self.key[chosen], self.used[chosen] = key, 0
        self.free_map[chosen, : self.dims.slab_bytes // key] = 1
        self.owner[chosen] = owner
        self.state[chosen] = SlabState.PARTIAL
        self.lent_to[chosen] = 0
        self.lent_gen[chosen] += 1
        self.header[_Hdr.SLAB_EPOCH] += 1
        return chosen

    def _carvable_locked(self, lowest: int) -> np.ndarray:
        """FREE slabs in the order carves take them: unlent, lent, lent with a copy running."""
        free = self.state[lowest:] == SlabState.FREE
        lent = self.lent_to[lowest:] != 0
        busy = self.lent_busy[lowest:] != 0
        return np.concatenate([np.flatnonzero(free & ~lent), np.flatnonzero(free & lent & ~busy),
                               np.flatnonzero(free & lent & busy)]) + lowest

    def _wait_copies_locked(self, slabs: np.ndarray) -> None:
        """Wait (holding the lock) until no borrower copies into `slabs` (lent.py writes a slab
        outside the lock with its busy flag up: one slab's bytes at memcpy speed). A borrower
        that died mid-copy writes no more; one stopped mid-copy fails the carve after
        BUSY_WAIT_S rather than hang it (ArenaExhausted, nothing changed)."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            busy = slabs[self.lent_busy[slabs] != 0]
            if busy.size == 0:
                return
            slots = self.lent_to[busy].astype(np.int64) - 1
            if not any(self.identity_of(int(s)).is_alive() for s in slots if s >= 0):
                self.lent_busy[busy] = 0
                return
            if time.monotonic() > deadline:
                raise ArenaExhausted(f"slab(s) {busy.tolist()} lent and still being copied into "
                                     f"after {BUSY_WAIT_S} s (a stopped borrower?)")
            time.sleep(20e-6)

    def release(self, slot: int, slab_ids: Collection[int]) -> None:
        """Return empty slabs of `slot` to the free space."""
        with self.lock():
            for slab in slab_ids:
                if self.owner[slab] != slot or self.used[slab] != 0:
                    raise IntegrityError(f"slab {slab}: release by slot {slot} of a slab it "
                                         f"does not own empty (owner {self.owner[slab]}, used "
                                         f"{self.used[slab]})")
                self._free_slab_locked(int(slab))

    def release_locked(self, slab: int) -> None:
        """Return an empty slab to the free space (the caller holds the lock)."""
        self._free_slab_locked(slab)

    def reclaim_dead_owners(self) -> list[str]:
        """Free the slots and slabs of runtimes whose process is gone; returns their ids."""
        with self.lock():
            reclaimed = self._repaired_ids + self._reclaim_dead_locked()
            self._repaired_ids = []
            return reclaimed

    def _free_slab_locked(self, slab: int) -> None:
        self.state[slab] = SlabState.FREE
        self.owner[slab], self.key[slab], self.used[slab] = NO_OWNER, 0, 0
        self.free_map[slab] = 0
        self.block_owner[slab] = 0
        self.header[_Hdr.SLAB_EPOCH] += 1

    def _drop_runtime_locked(self, slot: int) -> None:
        for slab in np.flatnonzero(self.owner == slot):
            self._free_slab_locked(int(slab))
        self.drop_lent_locked(np.flatnonzero(self.lent_to == slot + 1))
        self.rt_lend_cap[slot] = 0
        self._drop_pooled_blocks_locked(self.block_owner == slot + 1)
        self.rt_status[slot] = self.rt_pooled[slot] = self.rt_limited[slot] = 0
        self.rt_limit[slot] = 0
        self.rt_pid[slot] = self.rt_start[slot] = self.rt_key[slot] = 0
        self.rt_name[slot] = 0

    def _drop_pooled_blocks_locked(self, dropped: np.ndarray) -> None:
        """Free the blocks of POOLED slabs marked in `dropped` (a block_owner-shaped mask)."""
        dropped = dropped & (self.owner == POOLED)[:, None]
        for slab in np.flatnonzero(dropped.any(axis=1)).tolist():
            row = dropped[slab]
            self.block_owner[slab, row] = 0
            self.free_map[slab, row] = 1
            self.used[slab] -= int(row.sum())
            if self.used[slab] == 0:
                self._free_slab_locked(slab)
            else:
                self.state[slab] = SlabState.PARTIAL

    def drop_lent_locked(self, slabs: np.ndarray) -> None:
        """Clear the lent marks of `slabs` (FREE already, no copy running into them): their
        pages are gone for the borrower, whose next check sees `lent_gen` changed."""
        self._wait_copies_locked(np.asarray(slabs, dtype=np.int64))
        self.lent_to[slabs] = 0
        self.lent_gen[slabs] += 1

    def _reclaim_dead_locked(self) -> list[str]:
        dead = [(slot, name) for slot, name in self.active_runtimes().items()
                if not self.identity_of(slot).is_alive()]
        for slot, name in dead:
            num_slabs = int(np.count_nonzero(self.owner == slot))
            pooled = int(np.count_nonzero((self.block_owner == slot + 1)
                                          & (self.owner == POOLED)[:, None]))
            logger.warning("slab table %s: runtime %r (pid %d) is dead; reclaiming its %d own "
                           "slab(s) and %d block(s) in its key pool", self.path, name,
                           self.rt_pid[slot], num_slabs, pooled)
            self._drop_runtime_locked(slot)
        return [name for _, name in dead]

    def _repair_locked(self) -> list[str]:
        """After a holder died mid-update: drop dead runtimes, make FREE slabs canonical, and
        rebuild every POOLED slab's counts from its block owners (all its changes happen under
        the lock, so the dead holder may have left one half-done)."""
        reclaimed = self._reclaim_dead_locked()
        for slab in np.flatnonzero(self.state == SlabState.FREE):
            self._free_slab_locked(int(slab))
        marks = self.lent_to.astype(np.int64)
        borrowers = np.clip(marks - 1, 0, self.dims.max_runtimes - 1)
        self.drop_lent_locked(np.flatnonzero((marks != 0) & (
            (self.state != SlabState.FREE) | (self.rt_status[borrowers] != 1))))
        self._repair_pooled_locked()
        slots = np.clip(self.owner, 0, self.dims.max_runtimes - 1)
        orphaned = (self.state != SlabState.FREE) & (self.owner != POOLED) & (
            (self.owner != slots) | (self.rt_status[slots] != 1))
        for slab in np.flatnonzero(orphaned):
            self._free_slab_locked(int(slab))
        for slot in np.flatnonzero(self.rt_status == 0):
            self._drop_runtime_locked(int(slot))
        return reclaimed


    def _repair_pooled_locked(self) -> None:
        self.block_owner[(self.owner != POOLED)] = 0
        active = np.zeros(256, dtype=bool)  # by block_owner value: slot + 1 of a pooled runtime
        active[1: self.dims.max_runtimes + 1] = (self.rt_status == 1) & (self.rt_pooled == 1)
        for slab in np.flatnonzero(self.owner == POOLED).tolist():
            bps = self.dims.slab_bytes // int(self.key[slab])
            row = self.block_owner[slab]
            row[bps:] = 0
            row[~active[row]] = 0  # blocks of runtimes no longer registered
            held = row[:bps] != 0
            self.free_map[slab, :bps] = ~held
            self.free_map[slab, bps:] = 0
            self.used[slab] = int(held.sum())
            if self.used[slab] == 0:
                self._free_slab_locked(slab)
            else:
                self.state[slab] = SlabState.FULL if self.used[slab] == bps else SlabState.PARTIAL


def read_header(fd: int, wait_s: float = _READY_TIMEOUT_S) -> np.ndarray:
    """The header of the table file `fd`, after it is ready; raises if it is not a table."""
    deadline = time.monotonic() + wait_s
    while True:
        raw = os.pread(fd, _HEADER_WORDS * 8, 0)
        header = np.frombuffer(raw.ljust(_HEADER_WORDS * 8, b"\0"), np.int64)
        if header[_Hdr.READY] == 1:
            break
        if time.monotonic() >= deadline:
            raise EnvironmentSetupError("slab table never became ready (creator died early?)")
        time.sleep(0.01)
    if header[_Hdr.MAGIC] != MAGIC or header[_Hdr.VERSION] != VERSION:
        raise EnvironmentSetupError("file is not a fineslab slab table of this version")
    return header


def creator_of_header(header: np.ndarray) -> ProcessIdentity:
    return ProcessIdentity(int(header[_Hdr.CREATOR_PID]), int(header[_Hdr.CREATOR_START]))

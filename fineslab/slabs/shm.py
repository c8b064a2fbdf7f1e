"""Shared-memory files and process identity: the OS-facing half of the arena and the table.

Files live in /dev/shm (tmpfs; a temp folder where there is none), are created with O_EXCL and
mode 0600 (only the fleet's user can map them), and are named from the fleet id and the device,
so that every process of a fleet finds them without passing paths around:

    /dev/shm/fineslab-<fleet_id>-<device>.table    slab table (always)
    /dev/shm/fineslab-<fleet_id>-<device>.arena    arena bytes (CPU backing only)

A process is identified by (pid, start time in clock ticks since boot): a pid alone is reused by
the kernel, the pair is not. A zombie (killed, not yet reaped) counts as dead.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.proctree import default_shm_dir

_NAME_PART = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def arena_device(device: str, gpu_id: int | None = None) -> str:
    """The one name an arena's device goes by, "cpu:0" or "cuda:1", from a launcher's device
    name ("cpu", "cuda:1") or from SGLang's `device` and `gpu_id` ("cpu", 0).

    The plugin and the launcher must agree on it: it names the arena's shared-memory files
    (`shm_stem` drops the colon: `...-cpu0.*`)."""
    if ":" in device:
        return device
    return f"{device}:{0 if gpu_id is None else gpu_id}"


def shm_stem(fleet_id: str, device: str) -> str:
    """`fineslab-<fleet_id>-<device>`; `device` "cuda:0" becomes "cuda0"."""
    device_part = device.replace(":", "")
    for label, part in (("fleet id", fleet_id), ("device", device_part)):
        if not _NAME_PART.match(part):
            raise ConfigError(f"{label} {part!r} must be 1-64 characters of [A-Za-z0-9_.-]")
    return f"fineslab-{fleet_id}-{device_part}"


@dataclass(frozen=True)
class ArenaPaths:
    table: Path
    data: Path

    @classmethod
    def of(cls, fleet_id: str, device: str, shm_dir: Path | None = None) -> ArenaPaths:
        folder = shm_dir or default_shm_dir()
        stem = shm_stem(fleet_id, device)
        return cls(folder / f"{stem}.table", folder / f"{stem}.arena")

    def unlink(self) -> None:
        for path in (self.table, self.data):
            path.unlink(missing_ok=True)


def create_file(path: Path, size_bytes: int) -> int:
    """Create `path` exclusively with mode 0600 and size `size_bytes`; returns the fd.

    Raises FileExistsError when it exists (the caller decides whether it is stale).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size_bytes)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def shm_huge_pages(folder: Path | None = None) -> str:
    """The huge-page setting of the tmpfs holding `folder` (default: the arena's folder), from
    /proc/mounts: "never" (tmpfs's default), "advise", "within_size" or "always"; "n/a" where
    the folder is not on tmpfs or the mounts are unreadable. With anything but "never" the
    arena's mappings get huge pages (slabs/weights.py, HUGE_PAGE_BYTES)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "n/a"
    return huge_setting_of(os.path.realpath(folder or default_shm_dir()), mounts)


def huge_setting_of(target: str, mounts: list[str]) -> str:
    """`shm_huge_pages` over /proc/mounts lines: the innermost mount holding `target`."""
    best, setting = "", "n/a"
    for line in mounts:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best = point
            options = dict(o.partition("=")[::2] for o in fields[3].split(","))
            setting = options.get("huge", "never") if fields[2] == "tmpfs" else "n/a"
    return setting


def open_file(path: Path, writable: bool) -> int:
    return os.open(path, os.O_RDWR if writable else os.O_RDONLY)


def map_fd(fd: int, size_bytes: int, writable: bool) -> mmap.mmap:
    access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
    return mmap.mmap(fd, size_bytes, access=access)

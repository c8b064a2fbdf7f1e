"""Trim a wheel: drop the parts of a package the GPU checks never import, keep it installable.

A wheel is a zip with a `*.dist-info/RECORD` listing every file with its hash and size; pip
checks the files it installs against it. `trim_wheel` writes a copy without the dropped files
and without their RECORD lines (every kept line, hash included, is unchanged), so pip installs
the rest as it would the original.

What the sglang wheel loses (37.2 MiB -> about 14 MiB), and why (`SGLANG_DROPS`):
- `sglang/multimodal_gen/`: SGLang's image and video generation runtime, a separate server;
  nothing of the language-model server imports it.
- `sglang/test/`: SGLang's own test suite and its helpers.
- the Rust extensions `_server`, `_bench`, `_grpc`, `_multimodal`
  (`sglang/srt/rust_extensions/`, 42 MiB unpacked): the Rust HTTP front, benchmark, gRPC
  server and multimodal processor; the Python server path used here imports none of them.
  (`mem_cache/rust_tree_core` stays: the radix tree's core; the check selects its Python
  backend with `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`, but the module is imported.)
"""

from __future__ import annotations

import fnmatch
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Drop:
    """Files to leave out: a glob over the wheel's paths, and why."""

    pattern: str
    why: str


SGLANG_DROPS = (
    Drop("sglang/multimodal_gen/*", "image and video generation runtime, never imported"),
    Drop("sglang/test/*", "SGLang's own test suite"),
    Drop("sglang/srt/rust_extensions/_server.*", "Rust HTTP front; the Python server is used"),
    Drop("sglang/srt/rust_extensions/_bench.*", "Rust benchmark tool"),
    Drop("sglang/srt/rust_extensions/_grpc.*", "Rust gRPC server"),
    Drop("sglang/srt/rust_extensions/_multimodal.*", "Rust multimodal processor"),
)


@dataclass(frozen=True)
class Dropped:
    path: str
    bytes: int
    why: str


@dataclass(frozen=True)
class Trimmed:
    """The trimmed wheel and what left it."""

    wheel: Path
    dropped: tuple[Dropped, ...]

    @property
    def dropped_bytes(self) -> int:
        return sum(d.bytes for d in self.dropped)


class WheelError(ValueError):
    """Not a wheel this tool can trim (no RECORD, or a drop that would remove its metadata)."""


def _record_name(names: Sequence[str]) -> str:
    records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise WheelError(f"expected one *.dist-info/RECORD, found {records or 'none'}")
    return records[0]


def _drop_of(name: str, drops: Sequence[Drop]) -> Drop | None:
    return next((d for d in drops if fnmatch.fnmatchcase(name, d.pattern)), None)


def trim_wheel(source: Path, out_dir: Path, drops: Sequence[Drop]) -> Trimmed:
    """Write `source` without the files `drops` match into `out_dir` (same file name)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    if target.resolve() == source.resolve():
        raise WheelError(f"{source}: the trimmed wheel would overwrite its source")
    dropped: list[Dropped] = []
    with zipfile.ZipFile(source) as wheel:
        infos = wheel.infolist()
        record = _record_name([i.filename for i in infos])
        dist_info = record.rsplit("/", 1)[0] + "/"
        for info in infos:
            drop = _drop_of(info.filename, drops)
            if drop is None:
                continue
            if info.filename.startswith(dist_info):
                raise WheelError(f"{drop.pattern!r} would drop the wheel's metadata "
                                 f"{info.filename}")
            dropped.append(Dropped(info.filename, info.file_size, drop.why))
        gone = {d.path for d in dropped}
        kept_record = [line for line in wheel.read(record).decode().splitlines()
                       if line and line.rsplit(",", 2)[0] not in gone]
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if info.filename in gone:
                    continue
                if info.filename == record:
                    out.writestr(info, "\n".join(kept_record) + "\n")
                else:
                    out.writestr(info, wheel.read(info))
    return Trimmed(target, tuple(dropped))

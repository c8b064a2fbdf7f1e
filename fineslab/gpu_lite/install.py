"""Install the carry on the GPU machine: unpack its wheels into `.gpu/site`, without pip.

    python -m fineslab.gpu_lite.install [--carry .gpu]

The machine has no registry and may have no pip; a wheel is a zip laid out as its install, so
unpacking is the install: each wheel's files go under `site/` (a `*.data/purelib/` or
`*.data/platlib/` folder's files to the top, as pip puts them; other `*.data` parts, such as
scripts, are not needed and skipped). Then fineslab's own entry point for SGLang's plugin group
(`sglang.srt.plugins`, as pyproject.toml declares it) is written as a `dist-info` there, since
fineslab itself is not installed on that machine but imported from the checkout: without it
SGLang would never load the plugin. Checks every file against the carry's manifest first; a
carry that does not match is refused. Prints the `PYTHONPATH` to use as its last line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

from fineslab.errors import FatalError

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINT = "fineslab = fineslab.sglang_plugin:register"


def verify(carry: Path) -> int:
    """Check every file the manifest lists (bytes and sha256); the number checked."""
    try:
        manifest = json.loads((carry / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise FatalError(f"{carry}: no readable manifest.json ({exc}); build the carry with "
                         "scripts/gpu_bundle.sh") from None
    for entry in manifest["files"]:
        path = carry / entry["path"]
        try:
            data = path.read_bytes()
        except OSError:
            raise FatalError(f"{path}: listed in the manifest, missing") from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise FatalError(f"{path}: differs from the manifest (a partial or stale carry)")
    return len(manifest["files"])


def unpack(wheel: Path, site: Path) -> int:
    """Unpack one wheel into `site` as pip would lay it out; the number of files written."""
    written = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if ".." in parts or info.filename.startswith("/"):
                raise FatalError(f"{wheel.name}: unsafe path {info.filename!r}")
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            if info.external_attr >> 16 & 0o111:
                target.chmod(0o755)
            written += 1
    return written


def write_entry_point(site: Path) -> Path:
    """A dist-info declaring fineslab's SGLang plugin (fineslab is imported from the checkout)."""
    dist = site / "fineslab_gpu_lite_plugin-0.0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fineslab-gpu-lite-plugin\n"
                                   "Version: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{ENTRY_POINT}\n")
    return dist


def install(carry: Path) -> Path:
    """Verify the carry and unpack it; the site folder."""
    checked = verify(carry)
    site = carry / "site"
    if site.exists():
        shutil.rmtree(site)
    site.mkdir()
    wheels = sorted((carry / "wheels").glob("*.whl"))
    files = sum(unpack(wheel, site) for wheel in wheels)
    write_entry_point(site)
    print(f"gpu_lite.install: {checked} carried files verified; {len(wheels)} wheels, "
          f"{files} files into {site}", file=sys.stderr, flush=True)
    return site


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fineslab.gpu_lite.install",
        description="Unpack the gpu-lite carry's wheels into CARRY/site (no pip needed) and "
                    "print the PYTHONPATH that serves SGLang through fineslab from it.")
    parser.add_argument("--carry", type=Path, default=REPO / ".gpu", help="default: .gpu/")
    args = parser.parse_args(argv)
    try:
        site = install(args.carry.resolve())
    except FatalError as exc:
        print(f"gpu_lite.install: {exc}", file=sys.stderr)
        return 2
    print(":".join([str(site), str(args.carry.resolve() / "stubs"), str(REPO)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

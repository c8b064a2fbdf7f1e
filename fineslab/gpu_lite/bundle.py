"""Build the gpu-lite carry (`.gpu/`) on a machine with the package registry.

    python -m fineslab.gpu_lite.bundle [--out .gpu] [--wheels DIR] [--max-mib 55] [--json]
    bash scripts/gpu_bundle.sh [same options]

Steps, each reported on stderr:
1. the wheels of requirements/gpu-lite.txt, exact versions, no dependencies, as CPython 3.12
   manylinux x86_64 wheels (the GPU machine's Python): `pip download` into a temporary folder,
   or taken from `--wheels DIR` (a folder holding them already; nothing is downloaded);
2. the sglang wheel trimmed (`fineslab.gpu_lite.wheels.SGLANG_DROPS`, each drop with its why);
3. fineslab's CUDA stand-in for `sgl_kernel` (`fineslab/gpu_lite/stubs/`) and the stand-ins'
   shared machinery;
4. the generated models the device check serves, copied from the model cache (generated there
   first if missing), so that the device serves the very files the CPU results came from;
5. `manifest.json`: every file with its bytes and sha256, the pins, what the trim dropped.

It is built in a temporary folder beside `--out` and moved into place only when whole and
under `--max-mib` (the run tool carries 64 MiB with the working tree; the rest is headroom):
a carry over the limit is refused, and the previous `.gpu/` stays. The last line of stdout is a
JSON object: `bytes`, `files`, `out`, `sglang_trimmed_bytes`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from fineslab.errors import FatalError
from fineslab.gpu_lite.wheels import SGLANG_DROPS, Trimmed, trim_wheel

REPO = Path(__file__).resolve().parents[2]
PINS = REPO / "requirements" / "gpu-lite.txt"
STUBS = Path(__file__).resolve().parent / "stubs"
STUB_MACHINERY = REPO / "fineslab" / "cpu_mode" / "stubs" / "_fineslab_stubpkg.py"
MODELS = ("llama-tiny", "qwen2-tiny")
MAX_MIB = 55.0
#: The GPU machine's interpreter and the platform tags its pip accepts, newest first.
PYTHON_VERSION = "3.12"
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in (34, 28, 27, 26, 24, 17, 5)),
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")


def _say(message: str) -> None:
    print(f"gpu_bundle: {message}", file=sys.stderr, flush=True)


def read_pins(path: Path = PINS) -> list[str]:
    """`name==version` lines of the pins file (comments and blanks skipped)."""
    pins = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    pins = [p for p in pins if p]
    loose = [p for p in pins if "==" not in p]
    if loose:
        raise FatalError(f"{path}: every pin must be exact (name==version): {loose}")
    return pins


def _normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_for(pin: str, wheels: Sequence[Path]) -> Path:
    """The wheel of `pin` among `wheels` (by the file name's distribution and version)."""
    name, version = pin.split("==")
    for wheel in wheels:
        parts = wheel.name.split("-")
        if len(parts) >= 5 and _normal(parts[0]) == _normal(name) and parts[1] == version:
            return wheel
    raise FatalError(f"no wheel for {pin} (have: {', '.join(w.name for w in wheels) or 'none'})")


def download(pins: Sequence[str], into: Path) -> None:
    """`pip download` the pins' cp312 manylinux wheels, no dependencies."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp",
               "--disable-pip-version-check", "-q", "-d", str(into)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    _say(f"downloading {len(pins)} wheels (cp{PYTHON_VERSION.replace('.', '')}, manylinux)")
    done = subprocess.run([*command, *pins], capture_output=True, text=True, timeout=900,
                          check=False)
    if done.returncode != 0:
        raise FatalError("pip download failed:\n" + (done.stderr or done.stdout)[-2000:])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_models(into: Path, cache: Path) -> None:
    from fineslab.models.generate import ensure_model

    for name in MODELS:
        source = ensure_model(name, cache)
        shutil.copytree(source, into / name)


def build(out: Path, wheels_from: Path | None, max_mib: float, cache: Path) -> dict[str, object]:
    """Build the carry into `out` (see the module docstring); its figures."""
    pins = read_pins()
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".gpu-building-", dir=out.parent))
    try:
        source = work / "downloaded"
        source.mkdir()
        if wheels_from is None:
            download(pins, source)
        else:
            source = wheels_from
        available = sorted(source.glob("*.whl"))
        carry = work / "carry"
        (carry / "wheels").mkdir(parents=True)
        trimmed: Trimmed | None = None
        for pin in pins:
            wheel = wheel_for(pin, available)
            if pin.startswith("sglang=="):
                trimmed = trim_wheel(wheel, carry / "wheels", SGLANG_DROPS)
                _say(f"{wheel.name}: trimmed {wheel.stat().st_size / 2**20:.1f} -> "
                     f"{trimmed.wheel.stat().st_size / 2**20:.1f} MiB "
                     f"({len(trimmed.dropped)} files dropped)")
            else:
                shutil.copy2(wheel, carry / "wheels" / wheel.name)
        shutil.copytree(STUBS, carry / "stubs",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy2(STUB_MACHINERY, carry / "stubs" / STUB_MACHINERY.name)
        _say(f"copying the models {', '.join(MODELS)}")
        _copy_models(carry / "models", cache)
        files = sorted(p for p in carry.rglob("*") if p.is_file())
        listed = [{"path": str(p.relative_to(carry)), "bytes": p.stat().st_size,
                   "sha256": _sha256(p)} for p in files]
        total = sum(p.stat().st_size for p in files)
        manifest = {
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": PYTHON_VERSION, "pins": pins, "files": listed, "bytes": total,
            "trimmed": [] if trimmed is None else [
                {"path": d.path, "bytes": d.bytes, "why": d.why} for d in trimmed.dropped],
        }
        (carry / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        total += (carry / "manifest.json").stat().st_size
        if total > max_mib * 2**20:
            raise FatalError(f"the carry would be {total / 2**20:.1f} MiB, over the "
                             f"{max_mib:g} MiB limit: nothing written ({out} unchanged)")
        if out.exists():
            shutil.rmtree(out)
        os.replace(carry, out)
        _say(f"{out}: {len(files) + 1} files, {total / 2**20:.1f} MiB")
        return {"bytes": total, "files": len(files) + 1, "out": str(out),
                "sglang_trimmed_bytes": 0 if trimmed is None else trimmed.dropped_bytes}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fineslab.gpu_lite.bundle",
        description="Build the gpu-lite carry (.gpu/): SGLang's wheels for the air-gapped GPU "
                    "machine, fineslab's sgl_kernel stand-in and the test models.")
    parser.add_argument("--out", type=Path, default=REPO / ".gpu", help="default: .gpu/")
    parser.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                        help="take the wheels from DIR instead of downloading them")
    parser.add_argument("--max-mib", type=float, default=MAX_MIB,
                        help=f"refuse a carry above this size (default {MAX_MIB:g})")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="where the generated models are (default: the model cache)")
    parser.add_argument("--json", action="store_true",
                        help="accepted for symmetry with the benchmarks: the last line is "
                             "always the JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"gpu_bundle: --wheels {args.wheels}: no such folder", file=sys.stderr)
        return 2
    from fineslab.env import FineslabEnv

    cache = args.model_cache or Path(FineslabEnv.from_environ().model_cache_dir)
    try:
        figures = build(args.out, args.wheels, args.max_mib, cache)
    except FatalError as exc:
        print(f"gpu_bundle: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

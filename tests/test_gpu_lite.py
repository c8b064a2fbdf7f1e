"""The gpu-lite carry, built here without a download (issue #36): the wheel trimmer on a small
fake wheel (dropped files and their RECORD lines gone, the rest byte for byte, pip installs it),
the bundle from a folder of fake wheels (manifest, size limit, the previous carry kept on a
refusal), and the CUDA stand-in for `sgl_kernel` imported as SGLang's triton path imports it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fineslab.gpu_lite import bundle
from fineslab.gpu_lite.wheels import SGLANG_DROPS, Drop, WheelError, trim_wheel

STUB_FILES = {
    "sglang/__init__.py": b"__version__ = '0.5.23'\n",
    "sglang/srt/server.py": b"SERVE = True\n",
    "sglang/srt/rust_extensions/__init__.py": b"",
    "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so": b"\0" * 4096,
    "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so": b"\1" * 64,
    "sglang/test/test_utils.py": b"x = 1\n" * 100,
    "sglang/multimodal_gen/runtime.py": b"y = 2\n" * 100,
}


def _fake_wheel(folder: Path, name: str, version: str,
                files: dict[str, bytes] | None = None) -> Path:
    """A wheel pip accepts: files, METADATA, WHEEL and a RECORD with each file's hash."""
    files = files or {f"{name}/__init__.py": f"VERSION = {version!r}\n".encode()}
    dist = f"{name}-{version}.dist-info"
    files = {**files,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 .encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return wheel


def test_trimming_drops_the_files_and_their_record_lines_and_keeps_the_rest(
        tmp_path: Path) -> None:
    source = _fake_wheel(tmp_path, "sglang", "0.5.23", STUB_FILES)
    trimmed = trim_wheel(source, tmp_path / "out", SGLANG_DROPS)
    with zipfile.ZipFile(source) as before, zipfile.ZipFile(trimmed.wheel) as after:
        kept = set(after.namelist())
        assert {d.path for d in trimmed.dropped} == {
            "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so",
            "sglang/test/test_utils.py", "sglang/multimodal_gen/runtime.py"}
        assert not kept & {d.path for d in trimmed.dropped}
        for name in kept - {"sglang-0.5.23.dist-info/RECORD"}:
            assert after.read(name) == before.read(name), name
        record = after.read("sglang-0.5.23.dist-info/RECORD").decode().splitlines()
        old = before.read("sglang-0.5.23.dist-info/RECORD").decode().splitlines()
    assert record == [line for line in old if line.split(",")[0] in kept]
    assert "mem_cache.cpython-312" in " ".join(record), "the radix tree's core stays"
    assert trimmed.dropped_bytes == 4096 + 600 + 600
    assert all(d.why for d in trimmed.dropped)


def test_the_trimmed_wheel_installs_with_pip(tmp_path: Path) -> None:
    trimmed = trim_wheel(_fake_wheel(tmp_path, "sglang", "0.5.23", STUB_FILES), tmp_path / "out",
                         SGLANG_DROPS)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                           "--no-compile", "--disable-pip-version-check", "-q",
                           "--target", str(tmp_path / "site"), str(trimmed.wheel)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    site = tmp_path / "site"
    assert (site / "sglang/srt/server.py").read_bytes() == b"SERVE = True\n"
    assert not (site / "sglang/test").exists() and not (site / "sglang/multimodal_gen").exists()


def test_a_drop_that_would_remove_the_metadata_is_refused(tmp_path: Path) -> None:
    source = _fake_wheel(tmp_path, "pkg", "1.0")
    with pytest.raises(WheelError, match="metadata"):
        trim_wheel(source, tmp_path / "out", [Drop("pkg-1.0.dist-info/*", "no")])
    with pytest.raises(WheelError, match="overwrite"):
        trim_wheel(source, tmp_path, [])


def _fake_wheels(folder: Path) -> Path:
    folder.mkdir()
    for pin in bundle.read_pins():
        name, version = pin.split("==")
        _fake_wheel(folder, name, version, STUB_FILES if name == "sglang" else None)
    return folder


def test_the_bundle_writes_every_file_with_its_hash_and_what_the_trim_dropped(
        tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / ".gpu"
    figures = bundle.build(out, _fake_wheels(tmp_path / "wheels"), 55.0, model_cache)
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert on_disk == set(listed) | {"manifest.json"}
    for path, entry in listed.items():
        data = (out / path).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert len([p for p in listed if p.startswith("wheels/")]) == len(bundle.read_pins())
    assert {"stubs/sgl_kernel/__init__.py", "stubs/sgl_kernel/utils.py",
            "stubs/_fineslab_stubpkg.py", "models/llama-tiny/model.safetensors",
            "models/qwen2-tiny/config.json"} <= set(listed)
    assert (out / "models/llama-tiny/model.safetensors").read_bytes() == \
        (model_cache / "llama-tiny/model.safetensors").read_bytes(), "the CPU results' files"
    assert {t["path"] for t in manifest["trimmed"]} >= {"sglang/test/test_utils.py"}
    assert figures["files"] == len(on_disk)
    assert figures["bytes"] == sum((out / p).stat().st_size for p in on_disk)
    assert not list(tmp_path.glob(".gpu-building-*")), "no work folder left"


def test_a_carry_over_the_limit_is_refused_and_the_previous_one_stays(
        tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / ".gpu"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    wheels = _fake_wheels(tmp_path / "wheels")
    code = bundle.main(["--out", str(out), "--wheels", str(wheels), "--max-mib", "0.5",
                        "--model-cache", str(model_cache)])
    assert code == 2
    assert (out / "manifest.json").read_text() == "{}"
    assert not list(tmp_path.glob(".gpu-building-*"))
    assert bundle.main(["--out", str(out), "--wheels", str(tmp_path / "none")]) == 2


def test_a_missing_wheel_is_named(tmp_path: Path, model_cache: Path) -> None:
    wheels = _fake_wheels(tmp_path / "wheels")
    next(wheels.glob("uvicorn-*.whl")).unlink()
    with pytest.raises(bundle.FatalError, match=r"uvicorn==0\.54\.0"):
        bundle.build(tmp_path / ".gpu", wheels, 55.0, model_cache)


def test_the_cuda_stand_in_answers_what_sglangs_triton_path_asks() -> None:
    code = (
        "import sgl_kernel\n"
        "from sgl_kernel.utils import is_arch_support_pdl\n"
        "from sgl_kernel.kvcacheio import transfer_kv_all_layer\n"
        "from sgl_kernel import fused_add_rmsnorm\n"
        "print('PDL', is_arch_support_pdl())\n"
        "try:\n"
        "    import sgl_kernel.scalar_type\n"
        "except ImportError:\n"
        "    print('SCALAR_TYPE absent')\n"
        "try:\n"
        "    fused_add_rmsnorm(1, 2)\n"
        "except NotImplementedError as e:\n"
        "    print('ERR', e)\n"
        "print('FILE', sgl_kernel.__file__)\n"
    )
    stubs = Path(bundle.STUBS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(bundle.STUB_MACHINERY
                                                                         .parent)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "PDL False" in done.stdout and "SCALAR_TYPE absent" in done.stdout
    assert "ERR sgl_kernel.fused_add_rmsnorm was called" in done.stdout
    assert "gpu-lite" in done.stdout
    assert f"FILE {stubs}" in done.stdout


def test_the_carry_installs_without_pip_and_declares_fineslabs_plugin(
        tmp_path: Path, model_cache: Path) -> None:
    from fineslab.gpu_lite import install

    out = tmp_path / ".gpu"
    bundle.build(out, _fake_wheels(tmp_path / "wheels"), 55.0, model_cache)
    assert install.main(["--carry", str(out)]) == 0
    site = out / "site"
    assert (site / "sglang/srt/server.py").read_bytes() == b"SERVE = True\n"
    assert not (site / "sglang/test").exists()
    assert (site / "uvicorn/__init__.py").exists()
    # found, not imported: importing the stand-in registers torch ops (gpu_lite/fallbacks.py),
    # and this interpreter's path holds only the carry's fake wheels
    code = ("import importlib.metadata as m, importlib.util as u, sglang; "
            "print([e.value for e in m.entry_points(group='sglang.srt.plugins')]); "
            "print(u.find_spec('sgl_kernel').origin)")
    path = os.pathsep.join([str(site), str(out / "stubs")])
    done = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = "
                           f"{path.split(os.pathsep)!r}; {code}"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "['fineslab.sglang_plugin:register']" in done.stdout, "SGLang would load the plugin"
    assert str(out / "stubs" / "sgl_kernel" / "__init__.py") in done.stdout


def test_a_carry_that_differs_from_its_manifest_is_refused(
        tmp_path: Path, model_cache: Path) -> None:
    from fineslab.gpu_lite import install

    out = tmp_path / ".gpu"
    bundle.build(out, _fake_wheels(tmp_path / "wheels"), 55.0, model_cache)
    wheel = next((out / "wheels").glob("uvicorn-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:-10])
    assert install.main(["--carry", str(out)]) == 2
    assert not (out / "site").exists()
    assert install.main(["--carry", str(tmp_path / "nothing")]) == 2

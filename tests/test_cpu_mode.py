"""CPU mode: the stand-ins import, fail loudly when called, and reach child processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fineslab import cpu_mode
from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError


def _run_in_cpu_child(code: str) -> subprocess.CompletedProcess[str]:
    env = cpu_mode.child_environ()
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=False, timeout=120)


def test_child_environ_puts_stubs_first_and_enables_sglang_cpu_engine() -> None:
    env = cpu_mode.child_environ({"PYTHONPATH": "/a:/b", "PATH": "/bin"})
    assert env["PYTHONPATH"].split(":")[0] == str(cpu_mode.STUBS_DIR)
    assert env["PYTHONPATH"].split(":")[1:] == ["/a", "/b"], "existing entries are kept in order"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    again = cpu_mode.child_environ(env)
    assert again["PYTHONPATH"].count(str(cpu_mode.STUBS_DIR)) == 1, "idempotent"


def test_sgl_kernel_stand_in_imports_and_raises_a_clear_error_when_called() -> None:
    code = (
        "import sgl_kernel\n"
        "from sgl_kernel.kvcacheio import transfer_kv_all_layer\n"
        "from sgl_kernel import fused_add_rmsnorm\n"
        "try:\n"
        "    fused_add_rmsnorm(1, 2)\n"
        "except NotImplementedError as e:\n"
        "    print('ERR', e)\n"
        "print('FILE', sgl_kernel.__file__)\n"
    )
    result = _run_in_cpu_child(code)
    assert result.returncode == 0, result.stderr
    assert "ERR sgl_kernel.fused_add_rmsnorm was called" in result.stdout
    assert "needs a GPU build of SGLang" in result.stdout
    assert f"FILE {cpu_mode.STUBS_DIR}" in result.stdout, "the stand-in, not a real wheel"


def test_torchvision_stand_in_imports_and_raises_when_called() -> None:
    code = (
        "import torchvision.transforms.functional as F\n"
        "from torchvision.transforms import InterpolationMode\n"
        "mode = InterpolationMode.BICUBIC\n"
        "try:\n"
        "    F.resize(None, 4)\n"
        "except NotImplementedError as e:\n"
        "    print('ERR', e)\n"
    )
    result = _run_in_cpu_child(code)
    assert result.returncode == 0, result.stderr
    assert "ERR torchvision.transforms.functional.resize was called" in result.stdout


def test_sglang_imports_its_cpu_path_with_the_stand_ins() -> None:
    code = (
        "import sglang\n"
        "from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool\n"
        "from sglang.srt.model_executor.model_runner import ModelRunner\n"
        "print('ok', sglang.__version__)\n"
    )
    result = _run_in_cpu_child(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok 0.5.23")


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("0", False), ("", None),
                                                ("true", True), ("no", False)])
def test_cpu_mode_variable_is_a_tristate(raw: str, expected: bool | None) -> None:
    assert FineslabEnv.from_environ({"FINESLAB_CPU_MODE": raw}).cpu_mode is expected


def test_cpu_mode_variable_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match="FINESLAB_CPU_MODE"):
        FineslabEnv.from_environ({"FINESLAB_CPU_MODE": "maybe"})


def test_forced_cpu_mode_wins_over_detection() -> None:
    assert cpu_mode.is_cpu_mode(FineslabEnv(cpu_mode=True, model_cache_dir="x")) is True
    assert cpu_mode.is_cpu_mode(FineslabEnv(cpu_mode=False, model_cache_dir="x")) is False


def _server_args_in_child(build: str) -> dict[str, object]:
    """The CPU_SERVER_ARGS fields of the ServerArgs that `build` (code setting `args`) makes,
    in a CPU-mode child process."""
    code = (
        "import argparse, json\n"
        "from fineslab import cpu_mode\n"
        "from sglang.srt.server_args import ServerArgs\n"
        f"{build}"
        "print(json.dumps({k: getattr(args, k) for k in cpu_mode.CPU_SERVER_ARGS}))\n"
    )
    result = _run_in_cpu_child(code)
    assert result.returncode == 0, result.stderr[-2000:]
    fields: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return fields


def test_cpu_server_args_are_accepted_by_sglang_server_args() -> None:
    built = _server_args_in_child(
        "args = ServerArgs(model_path='unused', **cpu_mode.CPU_SERVER_ARGS)\n")
    assert built == cpu_mode.CPU_SERVER_ARGS


def test_cpu_server_argv_parses_back_to_the_cpu_server_args() -> None:
    parsed = _server_args_in_child(
        "parser = argparse.ArgumentParser()\n"
        "ServerArgs.add_cli_args(parser)\n"
        "ns = parser.parse_args(['--model-path', 'unused', *cpu_mode.cpu_server_argv()])\n"
        "args = ServerArgs.from_cli_args(ns)\n")
    assert parsed == cpu_mode.CPU_SERVER_ARGS


def test_forked_switches_sglangs_start_method_to_fork_after_sglang_forces_spawn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`fineslab.cpu_mode.forked` wraps the function where SGLang forces `spawn`: after it runs,
    the start method is `fork`; a seam that is gone leaves `spawn`, with a warning."""
    import multiprocessing
    import types

    from fineslab.cpu_mode import forked

    fake = types.ModuleType("fake_engine")
    fake._set_envs_and_config = lambda: multiprocessing.set_start_method(  # type: ignore[attr-defined]
        "spawn", force=True)
    monkeypatch.setitem(sys.modules, "fake_engine", fake)
    monkeypatch.setattr(forked, "FORK_TARGET", ("fake_engine", "_set_envs_and_config"))
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        assert forked.fork_children()
        fake._set_envs_and_config()  # type: ignore[attr-defined]
        assert multiprocessing.get_start_method() == "fork"
        del fake._set_envs_and_config  # type: ignore[attr-defined]
        # The warning is recorded at the logger itself: an in-process SGLang engine earlier
        # in the session reconfigures logging, and pytest's capture then sees nothing.
        warned: list[str] = []
        monkeypatch.setattr(forked.logger, "warning",
                            lambda message, *args: warned.append(message % args))
        assert not forked.fork_children()
        assert any("children are spawned" in w for w in warned), warned
    finally:
        multiprocessing.set_start_method(previous, force=True)


def test_a_cpu_server_is_started_through_the_forking_entry_and_a_gpu_one_is_not() -> None:
    from fineslab.runtime import ServerSpec

    assert ServerSpec("m", 1).argv()[1:4] == ["-m", "fineslab.cpu_mode.forked",
                                              "sglang.launch_server"]
    assert ServerSpec("m", 1, cpu=False).argv()[1:3] == ["-m", "sglang.launch_server"]

"""The mixed-precision fleet config: `--dry-run` on examples/cpu-mixed.yaml, the rules a mixed
config must follow, and a bad quantized checkpoint stopping the launch before any runtime
starts (no SGLang process in this file)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.plan import make_plan
from fineslab.quant.awq import AWQConfig, write_awq_checkpoint

REPO = Path(__file__).resolve().parents[2]
MIXED = REPO / "examples" / "cpu-mixed.yaml"
#: model -> (precision, KV dtype) as the dry-run table must show them.
EXPECTED = {"llama-bf16": ("bf16", "bf16"), "llama-fp8": ("fp8", "fp8_e4m3"),
            "llama-awq": ("awq", "fp16"), "llama-qoq": ("qoq", "int4")}


def _mixed() -> dict:
    return yaml.safe_load(MIXED.read_text())


def _launch(config: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FINESLAB_MODEL_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "fineslab.launch", "--config", str(config),
                           *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)


def test_dry_run_prints_all_four_models_with_precision_and_kv_dtype(tmp_path: Path) -> None:
    result = _launch(MIXED, tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0].endswith("-r0")}
    assert sorted(rows) == sorted(EXPECTED), result.stdout
    for model, (precision, kv) in EXPECTED.items():
        assert rows[model][3:5] == [precision, kv], f"{model}: {rows[model]}"
    assert "+ KV4 plugin pool" in " ".join(rows["llama-qoq"]), rows["llama-qoq"]
    assert "dequantized to bf16 + fp8 KV plugin pool" in " ".join(rows["llama-fp8"])
    assert not (tmp_path / "prepared").exists(), "--dry-run wrote no quantized checkpoint"


def _error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        make_plan(fleet_from_dict(data, "mixed.yaml"))
    return str(info.value)


def test_unknown_kv_dtype_is_named_with_its_path_and_the_allowed_ones() -> None:
    data = _mixed()
    data["models"][3]["kv_dtype"] = "int3"
    message = _error_of(data)
    assert "models[3].kv_dtype" in message and "'int4'" in message, message


def test_kv_dtype_the_precision_does_not_compute_in_is_refused() -> None:
    data = _mixed()
    data["models"][2]["kv_dtype"] = "bf16"  # awq computes in fp16
    assert "kv_dtype bf16 needs activations in bf16, but precision awq computes in fp16" in \
        _error_of(data)


def test_a_quantization_flag_in_extra_args_is_refused() -> None:
    data = _mixed()
    data["models"][0]["extra_args"] = ["--quantization", "fp8"]
    message = _error_of(data)
    assert "models[0] (llama-bf16): extra_args may not set ['--quantization']" in message


def test_quantized_kv_outside_the_arena_is_refused() -> None:
    data = _mixed()
    data["kv_pool"] = "sglang"
    message = _error_of(data)
    assert "models[3] (llama-qoq): kv_dtype int4 is stored only in the slab arena" in message
    del data["models"][3]
    assert "FP8 KV on CPU is stored only in the slab arena" in _error_of(data)


def test_runtime_env_may_not_override_the_launchers_variables() -> None:
    data = _mixed()
    data["models"][3]["env"] = {"FINESLAB_KV_FORMAT": "fp8_e4m3", "OMP_NUM_THREADS": "1"}
    assert "env may not set ['FINESLAB_KV_FORMAT']" in _error_of(data)


@pytest.mark.slow  # the launcher's zygote starts importing SGLang while it checks (counted)
def test_a_bad_awq_checkpoint_stops_the_launch_naming_the_file(tmp_path: Path,
                                                               model_cache: Path) -> None:
    awq = write_awq_checkpoint(model_cache / "llama-tiny", tmp_path / "awq",
                               AWQConfig(group_size=64))
    tensors = load_file(str(awq / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(awq / "model.safetensors"))
    data = _mixed()
    data["fleet_id"] = f"badckpt-{os.getpid()}"
    awq_model = {k: v for k, v in data["models"][2].items() if k != "preset"}
    data["models"] = [dict(awq_model, path=str(awq))]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    result = _launch(tmp_path / "bad.yaml", tmp_path / "cache")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"bad awq checkpoint {awq} (model.safetensors)" in result.stderr, result.stderr
    assert "model.layers.1.mlp.down_proj.scales: missing" in result.stderr, result.stderr
    assert "starting 1 runtimes" not in result.stdout, "no runtime was started"
    assert not list(Path("/dev/shm").glob(f"fineslab-{data['fleet_id']}-*")), "no arena left"
    assert not list(Path(tempfile.gettempdir()).glob(f"fineslab-{data['fleet_id']}-*")), \
        "no empty log folder left"

"""The precision registry (`fineslab.precisions`) is the one place a precision is described, and
everything that needs one reads it (issue #19, item 3)."""

from __future__ import annotations

import pytest
from fineslab.scheduler.kv_format import kv_token_bytes
from fineslab.scheduler.roofline import PRECISIONS as ROOFLINE

from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError
from fineslab.fleet.config import KV_DTYPES, PRECISIONS, fleet_from_dict
from fineslab.precisions import (
    NAMED_PRECISIONS,
    PLUGIN_KV_FORMATS,
    WEIGHT_FORMATS,
    config_kv_dtype,
    named_precision,
)
from fineslab.quant.serving import describe_serving
from fineslab.sglang_plugin.config import ArenaJoin
from fineslab.slabs.formats import KVDtype, KVShape
from fineslab.slabs.shm import arena_device

SPELLINGS = {
    KVDtype.BF16: ("bfloat16", "bf16", "torch.bfloat16"),
    KVDtype.FP16: ("float16", "fp16", "torch.float16"),
    KVDtype.FP32: ("float32", "fp32", "torch.float32"),
    KVDtype.FP8_E4M3: ("fp8_e4m3", "fp8", "torch.float8_e4m3fn"),
    KVDtype.INT4: ("int4",),
}


@pytest.mark.parametrize("dtype", list(KVDtype))
def test_every_spelling_of_a_kv_dtype_names_it(dtype: KVDtype) -> None:
    for name in SPELLINGS[dtype]:
        assert KVDtype.from_name(name) is dtype, name
    assert KVDtype.from_name(dtype.config_name) is dtype
    assert KVDtype.from_name(dtype.profile_name) is dtype


def test_an_unknown_kv_dtype_is_a_config_error_listing_the_known() -> None:
    with pytest.raises(ConfigError, match=r"unknown KV dtype 'int3'.*bf16"):
        KVDtype.from_name("int3")


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.FP16, KVDtype.FP32, KVDtype.FP8_E4M3,
                                   KVDtype.INT4])
@pytest.mark.parametrize("tp", [1, 2, 16])
def test_the_profiles_bytes_per_token_are_the_arenas(dtype: KVDtype, tp: int) -> None:
    """One formula: the scheduler's kv_token_bytes reads the block format's."""
    shape = KVShape("m", 32, 8, 128, dtype, tp)
    assert kv_token_bytes(32, 8, 128, dtype.profile_name, tp) == shape.token_bytes


def test_kv_shape_from_a_hugging_face_config() -> None:
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "hidden_size": 576}
    shape = KVShape.from_hf_config(config, "smol", KVDtype.INT4)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    no_kv_heads = KVShape.from_hf_config({**config, "num_key_value_heads": None,
                                          "head_dim": 96}, "m", KVDtype.BF16, tp_size=3)
    assert (no_kv_heads.num_kv_heads, no_kv_heads.head_dim, no_kv_heads.tp_size) == (9, 96, 3)
    with pytest.raises(ConfigError, match="'num_hidden_layers' is '30', not an int"):
        KVShape.from_hf_config({**config, "num_hidden_layers": "30"}, "m", KVDtype.BF16)


def test_the_launcher_accepts_exactly_the_registrys_names() -> None:
    assert set(PRECISIONS) == set(WEIGHT_FORMATS)
    assert set(KV_DTYPES) == {"auto", "bf16", "fp16", "fp8_e4m3", "int4"}
    assert all(config_kv_dtype(k).config_name == k for k in KV_DTYPES if k != "auto")


def _fleet(**model: object) -> dict:
    base = {"name": "m", "preset": "llama-tiny", "ttft_slo_s": 1.0, "request_rate_per_s": 1.0}
    return {"fleet_id": "f", "models": [{**base, **model}]}


@pytest.mark.parametrize("precision,auto_kv", [("bf16", "bf16"), ("fp16", "fp16"),
                                               ("fp8", "bf16"), ("awq", "fp16"),
                                               ("qoq", "int4")])
def test_kv_auto_is_the_registrys(precision: str, auto_kv: str) -> None:
    model = fleet_from_dict(_fleet(precision=precision), "<test>").models[0]
    assert model.resolved_kv_dtype == auto_kv
    assert model.kv is KVDtype.from_name(auto_kv)


def test_a_precision_outside_the_registry_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"precision: Input should be 'bf16'.*'qoq'"):
        fleet_from_dict(_fleet(precision="int3"), "<test>")
    with pytest.raises(ConfigError, match=r"kv_dtype: Input should be 'auto'.*'int4'"):
        fleet_from_dict(_fleet(kv_dtype="fp4"), "<test>")
    with pytest.raises(ConfigError, match="expected one of"):
        named_precision("w2a2")


@pytest.mark.parametrize("name,cpu,flag", [("awq", True, "awq"), ("awq", False, "awq"),
                                           ("fp8", True, None), ("fp8", False, "fp8"),
                                           ("qoq", True, None), ("qoq", False, None),
                                           ("bf16", False, None)])
def test_when_a_runtime_gets_quantization(name: str, cpu: bool, flag: str | None) -> None:
    assert WEIGHT_FORMATS[name].quantization_arg(cpu) == flag


def test_the_roofline_profiles_read_the_registry() -> None:
    for name, named in NAMED_PRECISIONS.items():
        roof = ROOFLINE[name]
        assert roof.weight_bytes_per_param == named.weights.roofline_bytes_per_param
        assert roof.compute_dtype == named.weights.roofline_compute
        assert KVDtype.from_name(roof.kv_dtype) is named.kv
    assert (ROOFLINE["qoq"].compute_dtype, ROOFLINE["qoq"].kv_dtype) == ("int8", "int4")


def test_the_dry_run_description_follows_the_kv_storage() -> None:
    assert describe_serving("qoq", "int4", "cuda:0").endswith("+ KV4 plugin pool")
    assert describe_serving("fp8", "fp8_e4m3", "cpu").endswith("+ fp8 KV plugin pool")
    assert describe_serving("fp8", "fp8_e4m3", "cuda:0").endswith("+ SGLang fp8 KV")
    assert describe_serving("bf16", "bf16", "cpu") == "source ckpt"


def test_one_arena_device_name_for_the_launcher_and_the_plugin() -> None:
    assert arena_device("cpu") == arena_device("cpu", 0) == "cpu:0"
    assert arena_device("cuda:1") == arena_device("cuda", 1) == "cuda:1"


def test_the_join_carries_the_kv_format_through_the_environment() -> None:
    join = ArenaJoin("fleet", "m", kv_format=KVDtype.FP8_E4M3, kv_scales_path="/s.json")
    again = ArenaJoin.from_env(FineslabEnv.from_environ(join.environ()))
    assert again == join
    assert set(PLUGIN_KV_FORMATS) == {"int4", "fp8_e4m3"}
    with pytest.raises(ConfigError, match="FINESLAB_KV_FORMAT='fp4'"):
        ArenaJoin.from_env(FineslabEnv.from_environ({**join.environ(),
                                                     "FINESLAB_KV_FORMAT": "fp4"}))
    with pytest.raises(ConfigError, match="the plugin stores"):
        ArenaJoin("fleet", "m", kv_format=KVDtype.BF16)
    with pytest.raises(ConfigError, match="fp8_e4m3 only"):
        ArenaJoin("fleet", "m", kv_format=KVDtype.INT4, kv_scales_path="/s.json")


def test_the_quantization_package_never_imports_the_launcher() -> None:
    """No launch <-> quant cycle: preparing a served model needs no launcher."""
    import subprocess
    import sys

    code = ("import sys, fineslab.quant.serving, fineslab.quant.gates, fineslab.precisions; "
            "print(sorted(m for m in sys.modules if m.startswith('fineslab.launch')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip() == "[]", done.stdout

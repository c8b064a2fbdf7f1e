"""Fleet config validation, profile lookup, placement and `--dry-run` (no SGLang process)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict, load_fleet_config
from fineslab.fleet.plan import (
    checkpoint_bytes,
    device_slab_plan,
    make_plan,
    prefill_chunk_args,
)
from fineslab.fleet.profiles import find_profile
from fineslab.fleet.runtimes import cpu_threads_env, server_spec
from fineslab.quant.serving import PrecisionRuntime
from fineslab.slabs import KVDtype, KVShape

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu-demo.yaml"


def _demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def _error_of(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        fleet_from_dict(data, "test.yaml")
    return str(info.value)


def test_demo_config_loads_with_four_models_of_two_kv_dtypes_one_of_them_real() -> None:
    config = load_fleet_config(DEMO)
    assert [m.name for m in config.models] == ["llama-bf16", "llama-small-fp16", "qwen2-bf16",
                                               "smollm2"]
    assert config.model("smollm2").preset == "smollm2-135m-instruct", "a model with words"
    assert {m.resolved_kv_dtype for m in config.models} == {"bf16", "fp16"}
    assert config.router.host == "127.0.0.1", "the router binds loopback by default"


def test_unknown_key_and_bad_value_are_named_with_their_path() -> None:
    data = _demo()
    data["models"][1]["kv_dtype"] = "int3"
    data["models"][0]["colour"] = "red"
    message = _error_of(data)
    assert "models[1].kv_dtype" in message, message
    assert "models[0].colour" in message, message


def test_model_needs_exactly_one_of_path_and_preset() -> None:
    data = _demo()
    data["models"][0]["path"] = "/tmp/x"
    assert "exactly one of `path`" in _error_of(data)
    del data["models"][0]["path"], data["models"][0]["preset"]
    assert "exactly one of `path`" in _error_of(data)


def test_kv_dtype_must_match_the_activation_dtype() -> None:
    data = _demo()
    data["models"][0]["kv_dtype"] = "fp16"  # precision bf16 computes in bf16
    assert "kv_dtype fp16 needs activations in fp16" in _error_of(data)


def test_duplicate_model_names_and_missing_models_are_refused() -> None:
    data = _demo()
    data["models"][1]["name"] = "llama-bf16"
    assert "duplicate names ['llama-bf16']" in _error_of(data)
    assert "models" in _error_of({"fleet_id": "x", "models": []})
    assert "expected a mapping" in _error_of(["not", "a", "mapping"])


def test_negative_slo_and_bad_drop_status_are_refused() -> None:
    data = _demo()
    data["models"][2]["ttft_slo_s"] = -1
    data["router"]["drop_status"] = 500
    message = _error_of(data)
    assert "models[2].ttft_slo_s" in message and "router.drop_status" in message, message


def test_missing_gpu_profile_names_the_file_to_make(tmp_path: Path) -> None:
    config = fleet_from_dict(_demo(), "test.yaml")
    with pytest.raises(ConfigError, match=r"llama-tiny--bf16--h100\.json.*fineslab\.profile"):
        find_profile(config.models[0], "h100", [tmp_path], None)


def test_measured_profile_beats_analytical_and_kv_bytes_follow_the_served_dtype(
        tmp_path: Path) -> None:
    config = fleet_from_dict(_demo(), "test.yaml")
    model = config.models[1]  # llama-small, fp16 KV
    model_dir = Path(make_plan(config).runtimes_of(model.name)[0].model_dir)
    estimate = find_profile(model, "cpu", [tmp_path], model_dir)
    assert estimate.source == "analytical", "no profile on disk: the CPU estimate is used"
    from fineslab.scheduler.profile_schema import profile_to_dict

    measured = profile_to_dict(estimate) | {"source": "measured", "kv_dtype": "bf16"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    name = "llama-small--fp16--cpu.json"
    (tmp_path / "a" / name).write_text(json.dumps(profile_to_dict(estimate)))
    (tmp_path / "b" / name).write_text(json.dumps(measured))
    found = find_profile(model, "cpu", [tmp_path / "a", tmp_path / "b"], None)
    assert found.source == "measured", "a measured profile wins over an analytical one"
    assert found.kv_dtype == "fp16" and found.kv_token_bytes == estimate.kv_token_bytes


def test_demo_plan_puts_four_runtimes_in_one_cpu_arena() -> None:
    plan = make_plan(load_fleet_config(DEMO))
    assert len(plan.arenas) == 1 and plan.arenas[0].device.name == "cpu"
    assert sorted(r.model.name for r in plan.runtimes) == [
        "llama-bf16", "llama-small-fp16", "qwen2-bf16", "smollm2"]
    slab_bytes = plan.arenas[0].slab_plan.slab_bytes
    assert plan.arenas[0].arena_bytes % slab_bytes == 0
    assert all(r.page_size and r.page_size > 0 for r in plan.runtimes)


def test_fp8_weights_on_cpu_are_planned_as_a_dequantized_checkpoint() -> None:
    data = _demo()
    data["models"][0]["precision"] = "fp8"
    data["models"][0]["kv_dtype"] = "auto"
    runtime = make_plan(fleet_from_dict(data, "test.yaml")).runtimes_of("llama-bf16")[0]
    assert runtime.serving == "fp8 ckpt, dequantized to bf16", runtime.serving


def test_dry_run_prints_the_plan_and_starts_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.launch", "--config", str(DEMO), "--dry-run"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "placement by mme" in result.stdout and "arenas" in result.stdout
    assert "qwen2-bf16-r0" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("runtime "))
    assert "block_B" in header and "padding" in header, "each runtime's block and waste shown"


def test_dry_run_with_a_bad_config_exits_2_with_the_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: x, preset: llama-tiny}]\n")
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.launch", "--config", str(bad), "--dry-run"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2
    assert "models[0].ttft_slo_s" in result.stderr, result.stderr


def test_replicas_on_one_device_share_their_key_pool_and_others_do_not() -> None:
    data = _demo()
    data["models"][0]["replicas"] = 2  # two llama-bf16 runtimes: the same block stride
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    by_id = {r.runtime_id: r for r in plan.runtimes}
    assert by_id["llama-bf16-r0"].key_pool and by_id["llama-bf16-r1"].key_pool
    strides = {f.name: f.block_stride_bytes for f in plan.arenas[0].slab_plan.formats}
    for r in plan.runtimes:
        same = [o for o in plan.runtimes if strides[o.runtime_id] == strides[r.runtime_id]]
        assert r.key_pool == (len(same) > 1), f"{r.runtime_id}: pooled iff it shares its key"
    prepared = PrecisionRuntime("llama-bf16", "bf16", Path(by_id["llama-bf16-r0"].model_dir),
                                KVDtype.BF16, ())
    spec = server_spec(by_id["llama-bf16-r0"], prepared, "f", use_arena=True)
    assert spec.env["FINESLAB_KEY_POOL"] == "1", "the runtime is told to join its key pool"
    assert "key pool" in plan.describe(), "--dry-run shows which runtimes share a key pool"


def test_the_launcher_chooses_pages_that_make_blocks_coincide() -> None:
    """The mixed fleet's FP8 KV is half BF16's a token; the launcher's plan (the key-sharing
    plan the fragmentation benchmark measures) gives FP8 twice BF16's page, so BF16, AWQ (fp16
    KV) and FP8 blocks are one size and share one key pool; KV4 cannot, and keeps its own."""
    plan = make_plan(load_fleet_config(REPO / "examples" / "cpu-mixed.yaml"))
    by_model = {r.model.name: r for r in plan.runtimes}
    fmt = {m: plan.arenas[0].slab_plan.format_of(r.runtime_id) for m, r in by_model.items()}
    assert fmt["llama-fp8"].tokens_per_block == 2 * fmt["llama-bf16"].tokens_per_block
    assert (fmt["llama-fp8"].block_stride_bytes == fmt["llama-bf16"].block_stride_bytes
            == fmt["llama-awq"].block_stride_bytes), fmt
    assert fmt["llama-qoq"].block_stride_bytes != fmt["llama-bf16"].block_stride_bytes, fmt
    assert {m: r.key_pool for m, r in by_model.items()} == {
        "llama-bf16": True, "llama-fp8": True, "llama-awq": True, "llama-qoq": False}
    assert all(r.page_size == fmt[m].tokens_per_block for m, r in by_model.items())


def test_a_block_beyond_the_key_sharing_range_falls_back_to_per_model_slabs(
        caplog: pytest.LogCaptureFixture) -> None:
    huge = KVShape("huge", 200, 64, 128, KVDtype.BF16)  # 6.5 MB a token: 105 MB blocks
    small = KVShape("small", 4, 2, 64, KVDtype.BF16)
    with caplog.at_level(logging.WARNING, logger="fineslab.fleet.plan"):
        plan = device_slab_plan([huge, small], 8 << 30, (16,))
    assert plan.slab_bytes > 64 << 20 and plan.within_bound, plan.slab_bytes
    assert "key-sharing slab plan not possible" in caplog.text


@pytest.mark.parametrize(("page", "extra", "expected"), [
    (16, (), ()),  # SGLang's own chunk (a multiple of 2048) is whole pages
    (20, (), ("--chunked-prefill-size", "4080")),
    (48, (), ("--chunked-prefill-size", "4080")),
    (20, ("--chunked-prefill-size", "2000"), ()),
    (20, ("--chunked-prefill-size=-1",), ()),  # chunking off
])
def test_prefill_chunk_is_whole_pages(page: int, extra: tuple[str, ...],
                                      expected: tuple[str, ...]) -> None:
    assert prefill_chunk_args("r", page, extra) == expected


def test_a_chunk_of_partial_pages_is_a_config_error_at_plan_time() -> None:
    data = _demo()
    data["models"][0]["extra_args"] = ["--chunked-prefill-size", "1000"]
    with pytest.raises(ConfigError, match="1000 is not a multiple of its arena page size"):
        make_plan(fleet_from_dict(data, "test.yaml"))
    with pytest.raises(ConfigError, match="not an integer"):
        prefill_chunk_args("r", 16, ("--chunked-prefill-size=lots",))


def test_server_spec_passes_a_whole_page_chunk_for_a_page_sglang_would_refuse() -> None:
    runtime = make_plan(load_fleet_config(DEMO)).runtimes_of("llama-bf16")[0]
    runtime = dataclasses.replace(runtime, page_size=20)
    prepared = PrecisionRuntime("llama-bf16", "bf16", Path(runtime.model_dir), KVDtype.BF16, ())
    args = list(server_spec(runtime, prepared, "f", use_arena=True).extra_args)
    assert args[args.index("--page-size") + 1] == "20"
    assert args[args.index("--chunked-prefill-size") + 1] == "4080"


def test_elastic_fields_are_checked_and_set_the_weights_in_arena() -> None:
    data = _demo()
    data["models"][0]["idle_timeout_s"] = 30
    data["models"][1]["pinned"] = True
    config = fleet_from_dict(data, "test.yaml")
    assert [m.elastic for m in config.models] == [True, True, False, False]
    data["models"][2].update(pinned=True, idle_timeout_s=5)
    assert "not both" in _error_of(data)
    data["models"][2].update(pinned=False, idle_timeout_s=0)
    assert "idle_timeout_s" in _error_of(data)
    data["models"][2].update(idle_timeout_s=5, replicas=2)
    assert "one replica" in _error_of(data)
    data["models"][2].pop("replicas")
    data["kv_pool"] = "sglang"
    assert "use kv_pool: arena" in _error_of(data)


def test_an_elastic_runtime_keeps_its_weights_in_an_arena_sized_for_them() -> None:
    plain = make_plan(fleet_from_dict(_demo(), "test.yaml"))
    data = _demo()
    data["models"][0]["idle_timeout_s"] = 30
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    elastic = plan.runtimes_of(data["models"][0]["name"])[0]
    assert elastic.weights_in_arena and not plan.runtimes_of(data["models"][1]["name"])[0] \
        .weights_in_arena
    slab = plan.arenas[0].slab_plan.slab_bytes
    assert slab == plain.arenas[0].slab_plan.slab_bytes
    added = plan.arenas[0].arena_bytes - plain.arenas[0].arena_bytes
    # the weights + 2%, rounded up to slabs, + 1 (`weight_slabs`), + slab 0, which weights never
    # take (the padding slab: the first KV draw parks it)
    assert checkpoint_bytes(Path(elastic.model_dir)) + slab < added <= \
        checkpoint_bytes(Path(elastic.model_dir)) * 1.02 + 3 * slab
    prepared = PrecisionRuntime(elastic.model.name, "bf16", Path(elastic.model_dir),
                                KVDtype.BF16, ())
    spec = server_spec(elastic, prepared, "f", True)
    assert spec.env.get("FINESLAB_WEIGHTS_IN_ARENA") == "1"
    assert "idle 30 s" in plan.describe()


def test_an_elastic_model_on_a_gpu_is_refused_until_the_cuda_weight_path_exists() -> None:
    data = _demo()
    data["devices"] = [{"name": "cuda:0", "kind": "h100", "memory_gib": 80}]
    data["models"] = [dict(data["models"][0], idle_timeout_s=30,
                           profile=str(REPO / "profiles" / "llama-3.1-8b--fp16--h100.json"))]
    with pytest.raises(ConfigError, match="CPU devices only"):
        make_plan(fleet_from_dict(data, "test.yaml"))
    data["models"][0].pop("idle_timeout_s")
    assert make_plan(fleet_from_dict(data, "test.yaml")).runtimes, "the same model, not elastic"


def test_an_over_committed_device_starts_the_models_it_does_not_hold_asleep() -> None:
    data = yaml.safe_load((REPO / "examples" / "cpu-elastic.yaml").read_text())
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    asleep = {r.model.name for r in plan.runtimes if r.starts_asleep}
    assert asleep == {"qwen-b"}, "pinned first, then config order while the room lasts"
    assert "starts asleep" in plan.describe()
    data["devices"][0].pop("weights_arena_mib")
    assert not any(r.starts_asleep for r in make_plan(fleet_from_dict(data, "t.yaml")).runtimes)
    data["devices"][0]["weights_arena_mib"] = 4  # less than the pinned model's weights
    with pytest.raises(ConfigError, match="pinned model llama-pinned needs"):
        make_plan(fleet_from_dict(data, "t.yaml"))
    data["devices"][0].update(weights_arena_mib=0, kv_arena_mib=4)
    data["models"] = [m for m in data["models"] if not m.get("pinned")]
    with pytest.raises(ConfigError, match="models that start asleep load first"):
        make_plan(fleet_from_dict(data, "t.yaml"))


def test_layer_streaming_fields_are_checked_and_set_the_weights_in_arena() -> None:
    data = _demo()
    data["models"][0]["layer_streaming"] = {"policy": "selectn", "interval": 2}
    data["models"][1]["layer_streaming"] = {"policy": "oneiros", "cap": 1, "priority": 3}
    config = fleet_from_dict(data, "test.yaml")
    assert [m.weights_in_arena for m in config.models] == [True, True, False, False]
    assert not any(m.elastic for m in config.models), "streaming never sleeps"
    streaming = config.models[1].layer_streaming
    assert streaming is not None and (streaming.cap, streaming.priority) == (1, 3)
    for bad, why in [({"policy": "selectn"}, "give interval"),
                     ({"policy": "selectn", "interval": 1}, "greater than or equal to 2"),
                     ({"policy": "selectn", "interval": 2, "cap": 1}, "`cap` is oneiros'"),
                     ({"policy": "oneiros", "interval": 2}, "`interval` is selectn's"),
                     ({"policy": "flexgen"}, "policy"),
                     ({"policy": "oneiros", "slots": 3}, "slots"),
                     ({"policy": "oneiros", "cap": 0}, "cap")]:
        data["models"][2]["layer_streaming"] = bad
        assert why in _error_of(data), bad
    data["models"][2]["layer_streaming"] = {"policy": "oneiros"}
    data["models"][2]["idle_timeout_s"] = 30
    assert "streams layers or sleeps, not both" in _error_of(data)
    data["models"][2].pop("idle_timeout_s")
    data["kv_pool"] = "sglang"
    assert "lends weight slabs to the slab arena" in _error_of(data)


def test_a_streaming_runtime_gets_room_for_its_layer_padding_and_its_plan_says_so() -> None:
    data = _demo()
    data["models"][0]["idle_timeout_s"] = 30
    elastic = make_plan(fleet_from_dict(data, "test.yaml"))
    data["models"][0].pop("idle_timeout_s")
    data["models"][0]["layer_streaming"] = {"policy": "selectn", "interval": 2}
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    runtime = plan.runtimes_of(data["models"][0]["name"])[0]
    slab = plan.arenas[0].slab_plan.slab_bytes
    layers = json.loads((Path(runtime.model_dir) / "config.json").read_text())[
        "num_hidden_layers"]
    assert plan.arenas[0].arena_bytes - elastic.arenas[0].arena_bytes == layers * slab, \
        "one slab per layer more than the same model's weights without streaming"
    prepared = PrecisionRuntime(runtime.model.name, "bf16", Path(runtime.model_dir),
                                KVDtype.BF16, ())
    env = server_spec(runtime, prepared, "f", True).env
    assert env.get("FINESLAB_WEIGHTS_IN_ARENA") == "1"
    assert env.get("FINESLAB_LAYER_STREAMING") == "1"
    assert "selectn i=2: layers [1, 3]" in plan.describe()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_a_max_total_tokens_that_is_not_a_positive_count_is_refused(value: str) -> None:
    data = _demo()
    data["models"][0]["extra_args"] = ["--max-total-tokens", value]
    assert "--max-total-tokens must be a positive number" in _error_of(data)


def test_the_routers_token_budget_is_the_runtimes_max_total_tokens_and_page() -> None:
    from fineslab.fleet.runtimes import OWN_POOL_MAX_TOTAL_TOKENS, token_budget

    data = _demo()
    data["models"][0]["extra_args"] = ["--max-total-tokens", "900", "--max-total-tokens=1024"]
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    by_model = {r.model.name: r for r in plan.runtimes}
    capped = by_model["llama-bf16"]
    budget = token_budget(capped, use_arena=True)
    assert budget is not None and (budget.total_tokens, budget.page_size) == (
        1024, capped.page_size), "the last flag wins, as in SGLang's parser"
    assert token_budget(by_model["qwen2-bf16"], use_arena=True) is None, "the arena's capacity"
    own = token_budget(by_model["qwen2-bf16"], use_arena=False)
    assert own is not None and (own.total_tokens, own.page_size) == (OWN_POOL_MAX_TOTAL_TOKENS, 1)


def test_the_routers_context_is_the_runtimes_context_length() -> None:
    from fineslab.fleet.machine import context_tokens

    hf = {"max_position_embeddings": 4096}
    assert context_tokens((), hf) == 4096
    assert context_tokens(("--context-length", "512"), hf) == 512, \
        "the router refused by 4,096 what the runtime refused past 512"
    assert context_tokens(("--context-length=1024",), {}) == 1024


def test_each_cpu_runtime_gets_its_share_of_the_cores_unless_the_operator_chose() -> None:
    """torch gives every runtime all the cores: four demo runtimes on two cores ran eight
    spinning compute threads. The launcher gives each CPU runtime its share (at least one);
    the launcher's own OMP_NUM_THREADS is the operator's choice, and a model's `env` wins over
    both (it goes on top in the spec)."""
    plan = make_plan(load_fleet_config(DEMO))
    assert len(plan.runtimes) == 4
    assert cpu_threads_env(plan.runtimes, {}, 2) == {"OMP_NUM_THREADS": "1"}
    assert cpu_threads_env(plan.runtimes, {}, 16) == {"OMP_NUM_THREADS": "4"}
    assert cpu_threads_env(plan.runtimes, {"OMP_NUM_THREADS": "3"}, 16) == {}, "the operator's"
    assert cpu_threads_env([], {}, 16) == {}
    data = _demo()
    data["models"][0]["env"] = {"OMP_NUM_THREADS": "2"}
    plan = make_plan(fleet_from_dict(data, "test.yaml"))
    shared = cpu_threads_env(plan.runtimes, {}, 4)
    prepared = PrecisionRuntime("x", "bf16", Path("/nonexistent"), KVDtype.BF16, ())
    specs = {r.model.name: server_spec(r, prepared, "f", use_arena=True, base_env=shared)
             for r in plan.runtimes}
    assert specs["llama-bf16"].env["OMP_NUM_THREADS"] == "2", "the model's env wins"
    assert specs["qwen2-bf16"].env["OMP_NUM_THREADS"] == "1"

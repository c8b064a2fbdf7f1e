"""Select-N's interval from the SLO at plan time (`interval: auto`; issue #17): the demo fleet's
llama-tiny with its measured CPU profile and generated checkpoint (no SGLang process)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from fineslab.scheduler.selectn import step_time_s
from safetensors import safe_open

from fineslab.errors import ConfigError
from fineslab.fleet.config import fleet_from_dict
from fineslab.fleet.layer_lending import write_selectn_requests
from fineslab.fleet.plan import make_plan
from fineslab.fleet.selectn_interval import choose_interval, decoder_layer_bytes
from fineslab.slabs.streamctl import read_request, request_path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu-demo.yaml"


def _auto(tpot_slo_s: float, **more: object) -> dict:
    data = yaml.safe_load(DEMO.read_text())
    data["models"][0]["layer_streaming"] = {"policy": "selectn", "interval": "auto",
                                            "tpot_slo_s": tpot_slo_s, **more}
    return data


def _choice_at(tpot_slo_s: float, **more: object):  # type: ignore[no-untyped-def]
    config = fleet_from_dict(_auto(tpot_slo_s, **more), "test.yaml")
    plan = make_plan(config)  # resolves; the choice is recomputed here from the same inputs
    model = config.models[0]
    runtime = plan.runtimes_of(model.name)[0]
    choice = choose_interval(model, plan.profiles[model.name], Path(runtime.model_dir), "cpu",
                             model.max_running_requests or config.router.max_running_requests)
    return plan, runtime, choice


def test_a_layers_bytes_are_its_tensors_bytes_in_the_checkpoint() -> None:
    _, runtime, _ = _choice_at(1.0)
    model_dir = Path(runtime.model_dir)
    per_layer: dict[int, int] = {}
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if ".layers." in name:
                    index = int(name.split(".layers.")[1].split(".")[0])
                    tensor = tensors.get_tensor(name)
                    per_layer[index] = per_layer.get(index, 0) + \
                        tensor.numel() * tensor.element_size()
    assert decoder_layer_bytes(model_dir) == max(per_layer.values()) > 0


def test_auto_picks_the_smallest_interval_whose_predicted_tpot_meets_the_slo() -> None:
    """Equation (5) over a sweep of TPOT SLOs around the model's own step time: the chosen
    interval meets the SLO and the one below it (when there is one) misses it."""
    _, _, loose = _choice_at(10.0)
    assert loose.interval == 2 and loose.meets_slo, loose
    t0 = loose.tpot_s  # nothing stalls at this size: t(2) = t(0)
    slow_link = 0.002  # GiB/s: a layer's copy is far longer than a step, so intervals differ
    seen = set()
    for factor in (1.05, 1.5, 2.0, 3.0, 100.0):
        _, runtime, choice = _choice_at(t0 * factor, host_link_gib_s=slow_link)
        num = len(choice.layers)
        assert choice.meets_slo or choice.interval == 0, choice
        if choice.interval >= 2:
            assert choice.tpot_s <= choice.tpot_slo_s * (1 + 1e-9)
            if choice.interval > 2:
                below = step_time_s(4, choice.interval - 1, choice.layer_transfer_s,
                                    t0 / 4)
                assert below > choice.tpot_slo_s, (choice, below)
            assert num == 4 // choice.interval
        seen.add(choice.interval)
        assert runtime.model.layer_streaming is not None
        assert runtime.model.layer_streaming.interval == choice.interval, "the plan uses it"
    assert len(seen) >= 2, f"the sweep should cross intervals: {seen}"


def test_an_slo_nothing_meets_streams_nothing_and_says_why(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "fineslab.fleet.selectn_interval"):
        plan, _, choice = _choice_at(1e-9)
    assert choice.interval == 0 and choice.layers == () and not choice.meets_slo
    assert "the SLO is missed even with every layer resident" in caplog.text
    assert "selectn i=0 (auto): nothing streams" in plan.describe()


def test_the_launcher_writes_the_chosen_layers_as_the_runtimes_request(tmp_path: Path) -> None:
    plan, runtime, choice = _choice_at(10.0)
    write_selectn_requests(plan, tmp_path)
    request = read_request(request_path(plan.config.fleet_id, runtime.runtime_id, tmp_path))
    assert request is not None and list(request.layers) == list(choice.layers) == [1, 3]
    assert "selectn i=2 (auto): layers [1, 3]" in plan.describe()


@pytest.mark.parametrize(("streaming", "why"), [
    ({"policy": "selectn", "interval": "auto"}, "give tpot_slo_s"),
    ({"policy": "selectn", "interval": 2, "tpot_slo_s": 0.1}, "they go with interval: auto"),
    ({"policy": "selectn", "interval": "auto", "tpot_slo_s": 0}, "greater than 0"),
    ({"policy": "selectn", "interval": "auto", "tpot_slo_s": 0.1, "host_link_gib_s": -1},
     "greater than 0"),
    ({"policy": "selectn", "interval": "sometimes"}, "interval"),
])
def test_bad_auto_fields_are_refused_with_the_reason(streaming: dict, why: str) -> None:
    data = yaml.safe_load(DEMO.read_text())
    data["models"][0]["layer_streaming"] = streaming
    with pytest.raises(ConfigError) as info:
        fleet_from_dict(data, "test.yaml")
    assert why in str(info.value), str(info.value)


def test_a_gpu_kind_has_no_default_link_and_must_name_it() -> None:
    config = fleet_from_dict(_auto(0.1), "test.yaml")
    plan = make_plan(config)
    model = config.models[0]
    with pytest.raises(ConfigError, match="host_link_gib_s"):
        choose_interval(model, plan.profiles[model.name],
                        Path(plan.runtimes_of(model.name)[0].model_dir), "h100", 8)


def test_auto_models_sharing_the_cpu_link_get_intervals_whose_copies_fit_it_together(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two auto models on a slow link: each alone picks interval 2 and its copies fill the
    link; together the per-link coordinator keeps their copies within it (one streams less or
    not at all), never below either one's own choice (its TTFT), and logs the decision."""
    from fineslab.scheduler.selectn import LinkCoordinator, LinkRuntime

    slow_link = 0.002  # GiB/s: every interval's step is copy-bound
    data = _auto(100.0, host_link_gib_s=slow_link)
    data["models"][2]["layer_streaming"] = dict(data["models"][0]["layer_streaming"])
    config = fleet_from_dict(data, "test.yaml")
    with caplog.at_level(logging.INFO, logger="fineslab.fleet.selectn_interval"):
        plan = make_plan(config)
    assert "select-n link:" in caplog.text
    coordinator = LinkCoordinator(slow_link * (1 << 30))
    rate, changed = 0.0, 0
    for model in (config.models[0], config.models[2]):
        runtime = plan.runtimes_of(model.name)[0]
        alone = choose_interval(model, plan.profiles[model.name], Path(runtime.model_dir), "cpu",
                                model.max_running_requests or config.router.max_running_requests)
        assert alone.interval == 2, f"alone, {model.name} streams every second layer"
        streaming = runtime.model.layer_streaming
        assert streaming is not None and streaming.interval is not None
        together = streaming.interval
        assert together == 0 or together >= alone.interval, "never below its own choice"
        changed += together != alone.interval
        decode_layer_s = plan.profiles[model.name].decode.step_s(
            model.max_running_requests or config.router.max_running_requests,
            round(plan.profiles[model.name].workload.mean_context_tokens)) / \
            plan.profiles[model.name].shape.num_layers
        rate += coordinator.stream_bytes_per_s(
            LinkRuntime(model.name, plan.profiles[model.name].shape.num_layers,
                        alone.layer_bytes, decode_layer_s, alone.tpot_slo_s), together)
    assert changed >= 1, "two copy-bound streams cannot both keep the whole link"
    assert rate <= slow_link * (1 << 30) * (1 + 1e-9), "their copies fit the link together"

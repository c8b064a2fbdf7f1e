"""The `fineslab_qoq` SGLang method: a real CPU engine serves a QoQ checkpoint of llama-tiny.

Reference: transformers' Llama in float32 with every projection replaced by `qoq.w4a8_linear`
over the tensors read back from the checkpoint (QoQ-dequantized weights, per-token INT8
activations, INT32 accumulation). The engine also runs in float32, so the two differ only in
kernel order (attention, norms, the float32 scaling); an INT8 activation code moves only when
such a rounding difference straddles a .5 boundary, and a greedy token only at a top-1 near tie.
Bound: all tokens equal. Measured: 192 of 192 tokens equal at 8 x 24 and 128 of 128 at 8 x 16
(what the test runs: the file must stay under 90 s on a loaded 2-core machine, where the engine
start alone took 54 s). No tie occurred, so the test asserts equality and names the first
divergence if a future change ever meets one.

Negative controls: the same engine, given a checkpoint with one layer's s1 scaled by 8 (SGLang's
`update_weights_from_disk`, which runs the method's post-load step again), serves different
tokens; a zeroed s1 is refused at load by `QoQWeight.check_integrity`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fineslab.errors import IntegrityError
from fineslab.quant.checkpoint import LINEAR_SUFFIXES
from fineslab.quant.qoq import QoQWeight, w4a8_linear
from fineslab.quant.qoq_checkpoint import qoq_tensors, read_qoq_linear, write_qoq_checkpoint
from fineslab.runtime import cpu_engine_kwargs, shutdown_engine, start_engine

PROMPT_LEN, NUM_PROMPTS, MAX_NEW_TOKENS = 12, 8, 16
CONTROL_LAYER = "model.layers.0.mlp.down_proj"


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(10, 2000, (NUM_PROMPTS, PROMPT_LEN), generator=gen).tolist()


@pytest.fixture(scope="module")
def qoq_dir(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qoq_checkpoint(model_cache / "llama-tiny",
                                tmp_path_factory.mktemp("qoq-sglang") / "llama-tiny-qoq")


class _W4A8Reference(torch.nn.Module):
    def __init__(self, weight: QoQWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_qoq, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a8_linear(x, self.weight_qoq, self.bias)


def _reference_greedy(src: Path, qoq: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tensors = load_file(str(qoq / "model.safetensors"))
    for i, block in enumerate(model.model.layers):
        for suffix in LINEAR_SUFFIXES:
            owner_name, name = suffix.split(".")
            owner = getattr(block, owner_name)
            weight = read_qoq_linear(tensors, f"model.layers.{i}.{suffix}")
            setattr(owner, name, _W4A8Reference(weight, getattr(owner, name).bias))
    out = model.generate(torch.tensor(prompts), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, PROMPT_LEN:].tolist()


def _engine_greedy(model_dirs: list[Path], prompts: list[list[int]]) -> list[list[list[int]]]:
    """Greedy outputs of one engine started on `model_dirs[0]`, then given each further
    checkpoint through SGLang's `update_weights_from_disk` (a second engine start would cost
    15-45 s here)."""

    # No --quantization: SGLang picks fineslab_qoq from config.json's quantization_config.
    engine = start_engine(**cpu_engine_kwargs({
        "model_path": str(model_dirs[0]), "dtype": "float32", "max_total_tokens": 4096,
        "log_level": "error"}))
    outputs = []
    try:
        for i, model_dir in enumerate(model_dirs):
            if i:
                ok, message, *_ = engine.update_weights_from_disk(str(model_dir))
                assert ok, f"SGLang could not reload the weights of {model_dir}: {message}"
                engine.flush_cache()
            outs = engine.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True})
            outputs.append([o["output_ids"] for o in outs])
    finally:
        shutdown_engine(engine)
    return outputs


def _edit_layer(qoq_dir: Path, out: Path, scale_s1: float) -> Path:
    shutil.copytree(qoq_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    weight = read_qoq_linear(tensors, CONTROL_LAYER)
    edited = QoQWeight(weight.packed, weight.s2, weight.z, weight.s1 * scale_s1,
                       weight.group_size)
    tensors.update(qoq_tensors(CONTROL_LAYER, edited))
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.slow
def test_engine_serves_qoq_like_the_w4a8_reference(model_cache: Path, qoq_dir: Path,
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from fineslab.sglang_plugin.qoq_method import register_qoq_method

    # An in-process engine's argv names no model: FINESLAB_QOQ=1 has its scheduler process
    # register the method; this process (which checks the model's config) registers it here.
    monkeypatch.setenv("FINESLAB_QOQ", "1")
    register_qoq_method()
    prompts = _prompts()
    control_dir = _edit_layer(qoq_dir, tmp_path / "control", 8.0)
    got, control = _engine_greedy([qoq_dir, control_dir], prompts)
    want = _reference_greedy(model_cache / "llama-tiny", qoq_dir, prompts)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        first = next((t for t, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        assert first is None, (f"prompt {i}: the engine leaves the W4A8 reference at token "
                               f"{first} ({g[first]} vs {w[first]}): fineslab_qoq must compute "
                               "what w4a8_linear computes")
    assert control != got, f"{CONTROL_LAYER}.s1 x 8 must change the served tokens"


def _loaded_linear(tensors: dict[str, torch.Tensor], layer: str) -> torch.nn.Module:
    """A bare module given the QoQ method's tensors and loaded the way SGLang's loader does."""
    from fineslab.sglang_plugin.qoq_method import QoQLinearConfig, QoQLinearMethod

    weight = read_qoq_linear(tensors, layer)
    n, k = weight.shape
    method = QoQLinearMethod(QoQLinearConfig(group_size=weight.group_size))
    linear = torch.nn.Module()
    method.create_weights(linear, k, [n], k, n, torch.float32)
    for name, tensor in qoq_tensors("", weight).items():
        getattr(linear, name[1:]).data.copy_(tensor)
    method.process_weights_after_loading(linear)
    linear.qoq_method = method  # type: ignore[assignment]
    return linear


def test_method_apply_equals_w4a8_linear(qoq_dir: Path) -> None:
    tensors = load_file(str(qoq_dir / "model.safetensors"))
    layer = "model.layers.1.self_attn.q_proj"
    linear = _loaded_linear(tensors, layer)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(256, generator=torch.Generator().manual_seed(4))
    got = linear.qoq_method.apply(linear, x, bias)  # type: ignore[operator]
    assert torch.equal(got, w4a8_linear(x, read_qoq_linear(tensors, layer), bias)), (
        "the SGLang method must compute exactly the reference W4A8 linear")


def test_zeroed_s1_is_refused_at_load(qoq_dir: Path) -> None:
    tensors = load_file(str(qoq_dir / "model.safetensors"))
    tensors[f"{CONTROL_LAYER}.s1"] = torch.zeros_like(tensors[f"{CONTROL_LAYER}.s1"])
    with pytest.raises(IntegrityError, match="s1"):
        _loaded_linear(tensors, CONTROL_LAYER)


def test_fineslab_qoq_is_registered_by_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.layers.quantization import get_quantization_config

    from fineslab.sglang_plugin import register
    from fineslab.sglang_plugin.qoq_method import QoQLinearConfig

    monkeypatch.setenv("FINESLAB_QOQ", "1")
    register()  # the entry point; no arena join in the environment
    assert get_quantization_config("fineslab_qoq") is QoQLinearConfig


def test_only_a_process_serving_a_qoq_checkpoint_registers_the_method(qoq_dir: Path,
                                                                       model_cache: Path) -> None:
    """Registering imports SGLang's layer modules: a detokenizer or a stock runtime must not
    pay for it, so the entry point registers only where the model needs it."""
    from fineslab.sglang_plugin.install import wants_qoq

    assert wants_qoq(["sglang", "--model-path", str(qoq_dir)], {})
    assert not wants_qoq(["sglang", "--model-path", str(model_cache / "llama-tiny")], {})
    assert not wants_qoq(["pytest"], {})
    assert wants_qoq(["pytest"], {"FINESLAB_QOQ": "1"})
    assert not wants_qoq(["sglang", "--model-path", "/no/such/model"], {})

"""The tiny model generator: deterministic, loadable by transformers, cached."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fineslab.errors import ConfigError
from fineslab.models.generate import PRESETS, SPEC_FILE, TinyModelSpec, ensure_model, write_model

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", SPEC_FILE)


def _digests(model_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in FILES}


def test_same_spec_writes_byte_identical_files(tmp_path: Path) -> None:
    first = write_model(PRESETS["qwen2-tiny"], tmp_path / "a")
    second = write_model(PRESETS["qwen2-tiny"], tmp_path / "b")
    assert _digests(first) == _digests(second)


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    spec = PRESETS["llama-tiny"]
    a = write_model(spec, tmp_path / "a")
    b = write_model(TinyModelSpec(**{**spec.__dict__, "seed": spec.seed + 7}), tmp_path / "b")
    assert _digests(a)["model.safetensors"] != _digests(b)["model.safetensors"]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_transformers_loads_model_and_tokenizer(model_cache: Path, preset: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = model_cache / preset
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = PRESETS[preset]
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
        spec.arch]
    assert len(tokenizer) == spec.vocab_size == model.config.vocab_size
    assert model.config.head_dim == 64
    ids = tokenizer("tell me about the slab arena").input_ids
    assert tokenizer.decode(ids) == "tell me about the slab arena", "byte-level BPE round-trips"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), spec.vocab_size)
    assert torch.isfinite(logits).all()


def test_chat_template_renders_chatml(model_cache: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_cache / "llama-tiny")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|end_of_text|>"


def test_ensure_model_reuses_a_fresh_cache_and_rewrites_a_stale_one(tmp_path: Path) -> None:
    first = ensure_model("llama-tiny", tmp_path)
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_model("llama-tiny", tmp_path) == first
    assert weights.stat().st_mtime_ns == mtime, "a fresh cache entry is not rewritten"

    marker = first / SPEC_FILE
    stale = json.loads(marker.read_text())
    stale["seed"] = 99
    marker.write_text(json.dumps(stale))
    again = ensure_model("llama-tiny", tmp_path)
    assert json.loads((again / SPEC_FILE).read_text())["seed"] == PRESETS["llama-tiny"].seed


def test_overrides_get_their_own_directory(tmp_path: Path) -> None:
    plain = ensure_model("llama-tiny", tmp_path)
    fp32 = ensure_model("llama-tiny", tmp_path, dtype="float32")
    assert plain != fp32
    assert json.loads((fp32 / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("arch", "gpt2", "arch"),
    ("num_heads", 3, "multiple of num_heads"),
    ("hidden_size", 384, "head_dim 96"),
    ("dtype", "int8", "dtype"),
])
def test_bad_spec_is_refused_clearly(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TinyModelSpec(**{field: value})  # type: ignore[arg-type]


def test_unknown_preset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model preset"):
        ensure_model("gpt-5", tmp_path)


def test_the_smollm2_preset_is_the_installed_model_or_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fleet may name the real SmolLM2 as `preset: smollm2-135m-instruct` (issue #39): it is
    # never generated; set-up installs it, and a fleet without it says how to install it.
    from fineslab.errors import ConfigError
    from fineslab.models import smollm2

    monkeypatch.setattr(smollm2, "DEFAULT_CACHE", tmp_path / "default")
    with pytest.raises(ConfigError, match="fineslab models smollm2"):
        ensure_model(smollm2.MODEL_NAME, tmp_path / "cache")
    installed = tmp_path / "default" / smollm2.MODEL_NAME
    installed.mkdir(parents=True)
    (installed / "model.safetensors").write_bytes(b"")
    assert ensure_model(smollm2.MODEL_NAME, tmp_path / "cache") == installed
    with pytest.raises(ConfigError, match="smollm2-135m-instruct"):
        ensure_model("no-such-model", tmp_path / "cache")

"""Write random-weight model directories of real architectures (Llama, Qwen2), deterministically.

Tests and the CPU demo need models, and nothing can be downloaded here. A generated model is a
complete Hugging Face directory that SGLang and `transformers` both load:

    <dir>/config.json              architecture, sizes, special token ids
    <dir>/generation_config.json   bos/eos ids only (greedy by default)
    <dir>/model.safetensors        weights, seeded normal init, in `dtype`
    <dir>/tokenizer.json           byte-level BPE trained locally (fineslab.models.tokenizer)
    <dir>/tokenizer_config.json    fast-tokenizer config with a ChatML chat template
    <dir>/fineslab-model.json      the spec it was made from, to detect a stale cache

head_dim is 64 so GPU attention kernels (triton, flashinfer) accept the models as they are.
Writing one takes about a second; the same spec gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fineslab.errors import ConfigError
from fineslab.models.tokenizer import SpecialTokens, build_tokenizer

logger = logging.getLogger(__name__)

SPEC_FILE = "fineslab-model.json"
# ChatML: the format Qwen2 uses; any template works for a random model, this one is common.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = SpecialTokens(
    bos="<|begin_of_text|>",
    eos="<|end_of_text|>",
    # transformers loads a qwen2 model's tokenizer as Qwen2Tokenizer, which appends
    # <|endoftext|> unless the vocabulary has it (the new id would fall outside the embedding
    # table), so every generated tokenizer carries it.
    extra=("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class TinyModelSpec:
    """What a generated model looks like. Defaults give a 4-layer, ~2.6M-parameter model."""

    arch: str = "llama"
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0
    # Standard deviation of the weight init. Larger than the usual 0.02 so that a random model's
    # logits are well separated and greedy decoding does not hinge on rounding differences
    # between engines.
    init_std: float = 0.1

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"arch {self.arch!r}: expected one of {sorted(ARCHITECTURES)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim not in (64, 128):
            raise ConfigError(f"head_dim {self.head_dim}: GPU kernels need 64 or 128")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype {self.dtype!r}: expected bfloat16, float16 or float32")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


#: Named presets used by tests, examples and the CPU demo fleet.
PRESETS: dict[str, TinyModelSpec] = {
    "llama-tiny": TinyModelSpec(arch="llama"),
    "qwen2-tiny": TinyModelSpec(arch="qwen2", num_layers=3, intermediate_size=640, seed=1),
    "llama-small": TinyModelSpec(
        arch="llama", hidden_size=512, intermediate_size=1024, num_layers=6, num_heads=8,
        num_kv_heads=4, vocab_size=4096, seed=2,
    ),
}


def _hf_config(spec: TinyModelSpec) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": spec.init_std,
    }
    if spec.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers
        )
    return config


def _weight_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes in the Hugging Face naming of both architectures."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (h, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.mlp.gate_proj.weight": (spec.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": (spec.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": (h, spec.intermediate_size),
        })
        if spec.arch == "qwen2":
            shapes.update({
                f"{p}.self_attn.q_proj.bias": (h,),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.bias": (kv,),
            })
    return shapes


def _write_weights(spec: TinyModelSpec, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    tensors = {}
    for name, shape in _weight_shapes(spec).items():
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=generator) * spec.init_std
        tensors[name] = value.to(dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(spec: TinyModelSpec, out_dir: Path) -> None:
    tokenizer = build_tokenizer(spec.vocab_size, SPECIAL_TOKENS, seed=spec.seed)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS.bos,
        "eos_token": SPECIAL_TOKENS.eos,
        "pad_token": SPECIAL_TOKENS.eos,
        "additional_special_tokens": list(SPECIAL_TOKENS.extra),
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_model(spec: TinyModelSpec, out_dir: str | os.PathLike[str]) -> Path:
    """Write the model for `spec` into `out_dir` (replaced atomically if it exists)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)
    try:
        _write_json(staging / "config.json", _hf_config(spec))
        _write_json(staging / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
        _write_weights(spec, staging / "model.safetensors")
        _write_tokenizer(spec, staging)
        _write_json(staging / SPEC_FILE, asdict(spec))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s model to %s", spec.arch, out)
    return out


def ensure_model(name: str, cache_dir: str | os.PathLike[str], **overrides: object) -> Path:
    """Return the directory of preset `name` under `cache_dir`, generating it if missing or stale.

    `overrides` replace fields of the preset (for example `dtype="float32"`); the directory name
    then carries a digest of the overrides so that variants do not overwrite each other.
    The real SmolLM2-135M-Instruct (`smollm2-135m-instruct`) is not generated: set-up installs
    it (`fineslab models smollm2`); it is looked for in `cache_dir`, then in the default cache.
    """
    from fineslab.models import smollm2

    if name == smollm2.MODEL_NAME and not overrides:
        return smollm2.require(Path(cache_dir))
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: expected one of "
                          f"{[*sorted(PRESETS), smollm2.MODEL_NAME]}")
    spec = replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
    suffix = "".join(f"-{key}={value}" for key, value in sorted(overrides.items()))
    out = Path(cache_dir) / f"{name}{suffix}"
    marker = out / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    return write_model(spec, out)

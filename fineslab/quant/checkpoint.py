"""Reading a source checkpoint and writing a quantized one beside it: the shared file plumbing.

A checkpoint here is a Hugging Face model directory: `config.json`, one or more
`*.safetensors` files, tokenizer files. Writers read every tensor of the source into memory
(fine for the tiny and small models the tests and the CPU demo use), transform them, and write
one `model.safetensors` plus an updated `config.json` into a staging folder that replaces the
output folder at the end, so a crashed writer never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fineslab.errors import ConfigError

logger = logging.getLogger(__name__)

#: The projections of a Llama/Qwen2 decoder layer that weight quantization converts.
LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
#: Files copied unchanged from the source checkpoint (those that exist).
_COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
)


def read_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / "config.json"
    if not path.exists():
        raise ConfigError(f"bad checkpoint {model_dir}: no config.json")
    config: dict[str, object] = json.loads(path.read_text())
    return config


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name (all shards)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"bad checkpoint {model_dir}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def is_quantized_linear(name: str) -> bool:
    """True for `model.layers.<i>.<projection>.weight` of a projection in LINEAR_SUFFIXES."""
    if not (name.startswith("model.layers.") and name.endswith(".weight")):
        return False
    return name[: -len(".weight")].split(".", 3)[-1] in LINEAR_SUFFIXES


@contextmanager
def staged_output(out_dir: Path) -> Iterator[Path]:
    """A staging folder that replaces `out_dir` when the block ends without an exception."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        yield staging
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_checkpoint(src_dir: Path, out_dir: Path, config: dict[str, object],
                     tensors: dict[str, torch.Tensor]) -> Path:
    """Write `config` and `tensors` as a model directory with `src_dir`'s tokenizer files."""
    with staged_output(out_dir) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        contiguous = {name: t.contiguous() for name, t in tensors.items()}
        save_file(contiguous, str(staging / "model.safetensors"))
        for name in _COPIED_FILES:
            if (src_dir / name).exists():
                shutil.copy2(src_dir / name, staging / name)
    logger.info("wrote %d tensors to %s", len(tensors), out_dir)
    return out_dir


def convert_checkpoint(src_dir: Path, out_dir: Path,
                       convert: Callable[[dict[str, object], dict[str, torch.Tensor]],
                                         tuple[dict[str, object], dict[str, torch.Tensor]]]
                       ) -> Path:
    """Read `src_dir`, apply `convert(config, tensors)`, write the result to `out_dir`."""
    config, tensors = convert(read_config(src_dir), read_tensors(src_dir))
    return write_checkpoint(src_dir, out_dir, config, tensors)

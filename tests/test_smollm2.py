"""The optional real model (make setup SETUP_ARGS=--smollm2) serves sensible text on CPU.

Skipped where set-up did not install it (the default, and CI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fineslab.env import FineslabEnv
from fineslab.models import smollm2
from fineslab.runtime import cpu_engine_kwargs, shutdown_engine, start_engine

MODEL_DIR = smollm2.find(Path(FineslabEnv.from_environ().model_cache_dir))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MODEL_DIR is None,
                       reason="SmolLM2 not installed (set-up --no-smollm2, or not fetched)"),
]


def test_sglang_serves_smollm2_with_a_correct_answer() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    engine = start_engine(**cpu_engine_kwargs({
        "model_path": str(MODEL_DIR), "max_total_tokens": 2048, "log_level": "error"}))
    try:
        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16})
    finally:
        shutdown_engine(engine)
    assert "Paris" in out["text"], f"real weights answer a fact correctly, got {out['text']!r}"

"""Models for tests and the CPU demo: generated tiny models, and optionally SmolLM2-135M.

`python -m fineslab.models generate [--preset NAME ...]` writes generated presets into the model
cache (FINESLAB_MODEL_CACHE, default ~/.cache/fineslab/models); `python -m fineslab.models
smollm2` installs the real SmolLM2-135M-Instruct there (set-up does it with `--smollm2`).
"""

"""`sglang.bench_serving` against a fineslab router (or any SGLang server), offline.

    python -m fineslab.bench.bench_serving [sglang.bench_serving args ...]

Runs SGLang's benchmark client (`python -m sglang.benchmark.serving`, which
`sglang.bench_serving` re-exports since 0.5.23) in a child process with the arguments as given,
after three changes that the bare command needs here:

- CPU mode (`cpu_mode.is_cpu_mode()`: FINESLAB_CPU_MODE, else no CUDA device visible): the
  child's environment is `cpu_mode.child_environ()`, the stand-in `torchvision` and
  `sgl_kernel` first on PYTHONPATH and SGLANG_USE_CPU_ENGINE=1. Without them the client dies
  importing SGLang: `No module named 'torchvision'`.
- `--dataset-name sharegpt` (SGLang's default) or `random` without `--dataset-path`: the
  child gets `--dataset-path` naming the ShareGPT-format file shipped with fineslab
  (`sharegpt_mini.DATASET_FILE`), put before the caller's arguments so that theirs win.
  SGLang would otherwise download ShareGPT from the Hugging Face hub; `random` needs it too,
  for the text it cuts its prompts from (`random-ids` needs no file).
- HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 (`OFFLINE_ENVIRON`), whatever the caller's
  environment: nothing is fetched from the network. So `--tokenizer` must name a local folder
  (a generated model's: `~/.cache/fineslab/models/llama-tiny`); without it the client asks the
  server's `/model_info`, which the router does not serve, then tries `--model` as a hub name,
  and stops. Its probe of `--model` for a chat template fails at once and only prints a warning.

Exit status: the child's (2 when `--tokenizer` is given and is not a local path).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from fineslab import cpu_mode
from fineslab.bench.sharegpt_mini import DATASET_FILE
from fineslab.env import FineslabEnv

logger = logging.getLogger(__name__)

#: SGLang's client; `sglang.bench_serving` is its deprecated alias (it warns on import).
SGLANG_CLIENT = "sglang.benchmark.serving"
#: The datasets for which SGLang downloads ShareGPT when `--dataset-path` is empty.
SHAREGPT_DATASETS = ("sharegpt", "random")
#: Hugging Face's switches: a hub lookup fails at once instead of reaching the network.
OFFLINE_ENVIRON = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _known_args(argv: Sequence[str]) -> argparse.Namespace:
    """The client's options this wrapper acts on; everything is passed through untouched.

    Spelled out only: an abbreviation (`--dataset-p`) is not seen here, and then it still
    wins, since the client reads it after the `--dataset-path` put before it."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dataset-name", default="sharegpt")
    parser.add_argument("--dataset-path", default="")
    parser.add_argument("--tokenizer", default=None)
    known, _ = parser.parse_known_args(list(argv))
    return known


def client_argv(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The child's command line: SGLang's client, the shipped dataset if needed, then `argv`."""
    known = _known_args(argv)
    dataset: list[str] = []
    if known.dataset_name in SHAREGPT_DATASETS and not known.dataset_path:
        dataset = ["--dataset-path", str(DATASET_FILE)]
    return [python, "-m", SGLANG_CLIENT, *dataset, *argv]


def client_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `base` (default: ours), CPU mode's if it is on, offline."""
    env = dict(os.environ if base is None else base)
    if cpu_mode.is_cpu_mode(FineslabEnv.from_environ(env)):
        env = cpu_mode.child_environ(env)
    env.update(OFFLINE_ENVIRON)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="fineslab.bench.bench_serving: %(message)s")
    tokenizer = _known_args(args).tokenizer
    if "-h" in args or "--help" in args:
        pass  # SGLang's own help, and no warning about what a help needs not
    elif tokenizer is None:
        logger.warning("no --tokenizer: the router has no /model_info and the hub is off; "
                       "pass a local model folder, e.g. ~/.cache/fineslab/models/llama-tiny")
    elif not Path(tokenizer).expanduser().exists():
        logger.error("--tokenizer %s is not a local path (nothing is downloaded here)",
                     tokenizer)
        return 2
    return subprocess.run(client_argv(args), env=client_environ(), check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())

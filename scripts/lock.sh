#!/usr/bin/env bash
# Re-resolve requirements/cpu.lock: install the .in files into a scratch venv with CPU torch held
# at 2.13.0, then freeze. Needs the package registry; takes about 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3 -m venv "$scratch/venv"
pip=("$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check)
echo "torch==2.13.0" > "$scratch/constraints.txt"
"${pip[@]}" torch==2.13.0
"${pip[@]}" -c "$scratch/constraints.txt" -r requirements/sglang-cpu.in -r requirements/dev.in
{
  echo "# Exact versions of the CPU-mode stack (everything but sglang itself, installed --no-deps)."
  echo "# Regenerate with: make lock (after changing requirements/sglang-cpu.in or dev.in)."
  "$scratch/venv/bin/python" -m pip freeze --all --exclude pip
} > requirements/cpu.lock
echo "wrote requirements/cpu.lock ($(grep -vc '^#' requirements/cpu.lock) packages)"

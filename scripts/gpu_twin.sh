#!/usr/bin/env bash
# The CPU twin of the air-gapped GPU machine's image, and the staged check's stages run there:
# what a developer runs before GPU time is spent (issue #36; docs/gpu.md). Not CI: it downloads
# about 5 GB (torch 2.11's CUDA build) once, into a virtual environment outside the repository.
#
#   bash scripts/gpu_twin.sh [--venv DIR] [--out DIR] [--stages env,stock,...] [--stage-timeout-s S]
#
# 1. DIR (default ~/.cache/fineslab/gpu-twin): Python 3.12 with requirements/gpu-twin.txt, the
#    image's versions (torch 2.11.0, triton 3.6.0, transformers 5.17.0) and its package set;
#    built once, again when that file changes. Python 3.12 is `$PYTHON312`, else python3.12 on
#    PATH, else pyenv's.
# 2. The carry (.gpu/; built first with scripts/gpu_bundle.sh when missing) installed as
#    scripts/gpu_check.sh installs it on the GPU machine (`fineslab.gpu_lite.install`, no pip),
#    fineslab imported from this checkout, not installed: as there.
# 3. `python -m fineslab.gpu_lite.check --device cpu` with the gpu-lite environment: every stage
#    on this CPU (OUT, default results/gpu-twin/, one log per stage; the last line is the JSON).
# Exit status: 0 when every stage passed, 1 when one failed, 2 when the twin could not be built.
set -uo pipefail
cd "$(dirname "$0")/.."
venv="$HOME/.cache/fineslab/gpu-twin"
out=results/gpu-twin
check_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=${2:?--venv needs a folder}; shift 2 ;;
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --stages|--stage-timeout-s) check_args+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: bash scripts/gpu_twin.sh [--venv DIR] [--out DIR] [--stages A,B]" \
            "[--stage-timeout-s S]" >&2; exit 2 ;;
  esac
done

py312=${PYTHON312:-}
if [ -z "$py312" ]; then
  if python3.12 -c '' 2>/dev/null; then  # a pyenv shim may exist and refuse to run
    py312=$(command -v python3.12)
  else
    py312=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
  fi
fi
if [ -z "$py312" ] || ! "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "gpu_twin: no Python 3.12 found (the GPU image's); set PYTHON312" >&2; exit 2
fi

stamp="$venv/.fineslab-twin-requirements"
if ! cmp -s requirements/gpu-twin.txt "$stamp"; then
  echo "== building the twin in $venv with $py312 (requirements/gpu-twin.txt; about 5 GB)"
  rm -rf "$venv"
  "$py312" -m venv "$venv" || exit 2
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -r requirements/gpu-twin.txt \
    || { echo "gpu_twin: installing the image's packages failed" >&2; exit 2; }
  cp requirements/gpu-twin.txt "$stamp"
fi
"$venv/bin/python" -c "import torch, triton, transformers; print('== twin: python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" || exit 2

if [ ! -f .gpu/manifest.json ]; then
  echo "== no carry in .gpu/: bash scripts/gpu_bundle.sh"
  bash scripts/gpu_bundle.sh | tail -n 1 || exit 2
fi
echo "== the carry, installed as on the GPU machine: python -m fineslab.gpu_lite.install"
lite_path=$(PYTHONPATH="$PWD" "$venv/bin/python" -m fineslab.gpu_lite.install --carry .gpu | tail -n 1) \
  || { echo "gpu_twin: the carry did not install" >&2; exit 2; }

echo "== staged check on this CPU: python -m fineslab.gpu_lite.check --device cpu --out $out"
mkdir -p "$out"
PYTHONPATH="$lite_path" FINESLAB_MODEL_CACHE="$PWD/.gpu/models" \
  SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python \
  "$venv/bin/python" -m fineslab.gpu_lite.check --device cpu --out "$out" "${check_args[@]}"

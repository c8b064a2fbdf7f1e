#!/usr/bin/env bash
# Every GPU check in one command, for any session that has a CUDA GPU:
#   bash scripts/gpu_check.sh            (after `make setup`, which installs the CUDA stack there)
# 1. the `gpu`-marked tests (CUDA IPC arena, strided-view attention, FP8/AWQ/KV4 kernels, ...);
# 2. each GPU benchmark, its JSON line kept in results/gpu/<name>.json.
# Write the figures into the docs named in each benchmark's docstring.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
out=results/gpu
mkdir -p "$out"
status=0

nvidia-smi -L || { echo "gpu_check: no CUDA GPU visible" >&2; exit 2; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2

echo "== gpu-marked tests"
FINESLAB_CPU_MODE=0 "$PY" -m pytest -m gpu -p no:cacheprovider tests -q | tee "$out/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# name|module and arguments; a benchmark whose module is not there yet is skipped by name.
BENCHES=(
  "alloc|fineslab.bench.alloc --device cuda"
  "pool-triton|fineslab.bench.pool --device cuda --attention-backend triton"
  "pool-flashinfer|fineslab.bench.pool --device cuda --attention-backend flashinfer"
  "precisions|fineslab.bench.precisions --device cuda"
)
for entry in "${BENCHES[@]}"; do
  name=${entry%%|*}; cmd=${entry#*|}; module=${cmd%% *}
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    echo "== $name: $module not present, skipped"; continue
  fi
  echo "== $name: python -m $cmd --json"
  # shellcheck disable=SC2086
  if FINESLAB_CPU_MODE=0 "$PY" -m $cmd --json | tee "$out/$name.log"; then
    tail -n 1 "$out/$name.log" > "$out/$name.json"
  else
    status=1
  fi
done
echo "gpu_check: results in $out/ (exit $status)"
exit $status

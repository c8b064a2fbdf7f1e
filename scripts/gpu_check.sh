#!/usr/bin/env bash
# Every GPU check in one command, for any session that has a CUDA GPU:
#   bash scripts/gpu_check.sh            (after `make setup`, which installs the CUDA stack there;
#                                        without .venv/, python3: the air-gapped GPU machine)
# On a machine where SGLang is not importable but the gpu-lite carry is here (.gpu/, built by
# scripts/gpu_bundle.sh and carried by the device tool), SGLang comes from the carry
# (`fineslab.gpu_lite.install`: verified against its manifest, unpacked into .gpu/site, no pip)
# with the gpu-lite environment (docs/gpu.md): fused ops in plain torch, the Python
# radix tree, the carried test models. Without either, only the checks that need torch alone
# run; the rest are named skipped.
# 0. the staged device check (`fineslab.gpu_lite.check`: env, stock SGLang, the slab pool,
#    sharing, weights in the arena asleep and awake, layer streaming on the copy stream, the
#    precisions' kernels and runtimes against their CPU references, bench.alloc and bench.pool),
#    each stage bounded and logged under $OUT (the device tool's) or results/gpu-lite/;
# 1. the `gpu`-marked tests (CUDA IPC arena, strided-view attention, FP8/AWQ/KV4 kernels, ...);
# 2. each GPU benchmark, its JSON line kept in results/gpu/<name>.json;
# 3. one table of every figure the benchmarks measured (`python -m fineslab.bench.report`).
# Write the figures into the docs named in each benchmark's docstring.
#
#   bash scripts/gpu_check.sh --staged [--stages A,B,...]
#                                        (step 0 alone: what a short GPU loan runs first; its
#                                        stages' bounds add up past one device command's 10
#                                        minutes, so a loan runs env,stock,slab-pool,sharing,weights
#                                        and then streaming,precisions,bench)
#
#   bash scripts/gpu_check.sh --check    (any machine, no GPU; CI runs it)
# runs nothing: parses every command below against its program's own argument parser
# (`python -m fineslab.bench.check_commands`; pytest by collecting), so that the one run a GPU
# is lent for does not die on a flag; exits 1 naming each broken command.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${FINESLAB_PYTHON:-.venv/bin/python}
if [ -z "${FINESLAB_PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then PY=python3; fi
if [ "$PY" != .venv/bin/python ]; then export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; fi
usage="usage: bash scripts/gpu_check.sh [--check | --staged [--stages A,B,...]]"
stages=()
case "${1:-}" in
  "") mode=run ;;
  --check) mode=check ;;
  --staged) mode=staged
    if [ "${2:-}" = --stages ]; then
      [ -n "${3:-}" ] || { echo "$usage" >&2; exit 2; }
      stages=(--stages "$3")
    elif [ -n "${2:-}" ]; then echo "$usage" >&2; exit 2; fi ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

# name|what follows `python -m`. Each benchmark also gets --json (its last line: the figures).
TESTS="tests|pytest -m gpu -p no:cacheprovider tests -q"
# Without SGLang (FINESLAB_PYTHON above), the gpu-marked tests that need only torch (no
# conftest: tests/precisions/conftest.py imports the launcher, which needs pydantic).
TESTS_TORCH="tests-torch|pytest -m gpu -p no:cacheprovider --noconftest tests/slabs/test_slab_cuda.py tests/slabs/test_cuda_vmm.py tests/slabs/test_layer_copy.py tests/precisions/test_qoq.py tests/precisions/test_qoq_triton.py -q"
BENCHES=(
  "hostlink|fineslab.bench.hostlink --device cuda --mib 2048"
  "layer-copy|fineslab.bench.layer_copy --device cuda"
  "cuda-wake|fineslab.bench.cuda_wake --device cuda --gib 4"
  "alloc|fineslab.bench.alloc --device cuda"
  "pool-triton|fineslab.bench.pool --device cuda --attention-backend triton"
  "pool-flashinfer|fineslab.bench.pool --device cuda --attention-backend flashinfer"
  "precisions|fineslab.bench.precisions --device cuda"
)
TORCH_ONLY=" hostlink layer-copy cuda-wake "  # benchmarks that run without SGLang

if [ "$mode" = check ]; then
  entries=("$TESTS" "$TESTS_TORCH" "gpu-lite|fineslab.gpu_lite.check --device cuda --out results/gpu-lite")
  for entry in "${BENCHES[@]}"; do entries+=("$entry --json"); done
  exec "$PY" -m fineslab.bench.check_commands "${entries[@]}"
fi

out=results/gpu
mkdir -p "$out"
status=0

nvidia-smi -L || { echo "gpu_check: no CUDA GPU visible" >&2; exit 2; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2

lite=no
if ! "$PY" -c "import sglang" 2>/dev/null && [ -f .gpu/manifest.json ]; then
  echo "== gpu-lite: SGLang from the carry (.gpu/)"
  if lite_path=$("$PY" -m fineslab.gpu_lite.install --carry .gpu | tail -n 1); then
    lite=yes
    export PYTHONPATH="$lite_path${PYTHONPATH:+:$PYTHONPATH}"
    export FINESLAB_MODEL_CACHE="$PWD/.gpu/models" SGLANG_FORCE_FUSED_OP_BACKEND=torch
    export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
  fi
fi
# The staged check runs wherever SGLang is meant to be there: its `env` stage says why an
# import failed.
if [ "$lite" = yes ] || "$PY" -c "import sglang" 2>/dev/null; then
  echo "== staged device check: python -m fineslab.gpu_lite.check --device cuda"
  FINESLAB_CPU_MODE=0 "$PY" -m fineslab.gpu_lite.check --device cuda --out "${OUT:-results/gpu-lite}" \
    ${stages[@]+"${stages[@]}"} || status=1
elif [ "$mode" = staged ]; then
  echo "gpu_check: no SGLang and no carry (.gpu/, scripts/gpu_bundle.sh): nothing to stage" >&2
  exit 2
fi
if [ "$mode" = staged ]; then exit $status; fi
if "$PY" -c "import sglang" 2>/dev/null; then sglang=yes; else
  sglang=no; TESTS=$TESTS_TORCH
  echo "gpu_check: SGLang is not importable by $PY: only the checks that need torch alone run"
fi

echo "== gpu-marked tests: python -m ${TESTS#*|}"
# shellcheck disable=SC2086
FINESLAB_CPU_MODE=0 "$PY" -m ${TESTS#*|} | tee "$out/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# A benchmark whose module is not there yet is skipped by name.
measured=()
for entry in "${BENCHES[@]}"; do
  name=${entry%%|*}; cmd=${entry#*|}; module=${cmd%% *}
  rm -f "$out/$name.json"  # a figure in the table below is one from this run
  if [ "$sglang" = no ] && [[ "$TORCH_ONLY" != *" $name "* ]]; then
    echo "== $name: needs SGLang, skipped"; continue
  fi
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    echo "== $name: $module not present, skipped"; continue
  fi
  echo "== $name: python -m $cmd --json"
  # shellcheck disable=SC2086
  if FINESLAB_CPU_MODE=0 "$PY" -m $cmd --json | tee "$out/$name.log"; then  # pipefail: python's status
    tail -n 1 "$out/$name.log" > "$out/$name.json"
    measured+=("$out/$name.json")
  else
    status=1
  fi
done

echo
if [ "${#measured[@]}" -gt 0 ]; then
  "$PY" -m fineslab.bench.report --title "GPU figures (results in $out/)" "${measured[@]}" || status=1
else
  echo "gpu_check: no benchmark measured anything"
fi
echo "gpu_check: results in $out/ (exit $status)"
exit $status

#!/usr/bin/env bash
# mypy over fineslab and the policies. scheduler/ ships as fineslab.scheduler (setup.py), a
# mapping mypy cannot see in the source tree, so it checks a tree of symlinks laid out the way
# the package is installed: build/typecheck/fineslab/{...,scheduler/}.
set -euo pipefail
cd "$(dirname "$0")/.."
root=build/typecheck
rm -rf "$root"
mkdir -p "$root"
cp -rs "$PWD/fineslab" "$root/fineslab"
cp -rs "$PWD/scheduler" "$root/fineslab/scheduler"
find "$root" -name __pycache__ -prune -exec rm -rf {} +
cd "$root"
exec ../../.venv/bin/python -m mypy --config-file ../../pyproject.toml -p fineslab "$@"

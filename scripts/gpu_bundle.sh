#!/usr/bin/env bash
# Build the gpu-lite carry (.gpu/) for the air-gapped GPU machine (issue #36): on a machine with
# the package registry, after `make setup`. Options as `python -m fineslab.gpu_lite.bundle`
# (--out DIR, --wheels DIR, --max-mib N). Its last line is a JSON object (bytes, files).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${FINESLAB_PYTHON:-.venv/bin/python}" -m fineslab.gpu_lite.bundle "$@"

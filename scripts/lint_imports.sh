#!/usr/bin/env bash
# The import contracts of pyproject.toml ([tool.importlinter]; docs/structure.md), checked by
# import-linter. `scheduler/` ships as `fineslab.scheduler` (setup.py), a mapping import-linter
# cannot follow, so it reads a copy of the package's .py files with scheduler/ in its place.
set -euo pipefail
cd "$(dirname "$0")/.."
view=$(mktemp -d)
trap 'rm -rf "$view"' EXIT
.venv/bin/python - "$view" <<'PY'
import shutil, sys
from pathlib import Path

view = Path(sys.argv[1])
for source, target in ((Path("fineslab"), view / "fineslab"),
                       (Path("scheduler"), view / "fineslab" / "scheduler")):
    for path in source.rglob("*.py"):
        if "stubs" in path.parts:
            continue
        copy = target / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
PY
cd "$view"
PYTHONPATH="$view" "$OLDPWD/.venv/bin/lint-imports" "$OLDPWD/pyproject.toml" --no-cache "$@"

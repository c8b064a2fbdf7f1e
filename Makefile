# fineslab: the two commands a new user needs are `make setup` and `make test`.
PY := .venv/bin/python
SETUP_ARGS ?=
# Test processes (pytest-xdist, one test file per worker at a time); 0 runs the suite in this process.
TEST_WORKERS ?= 2

.PHONY: setup test test-fast lint typecheck check gpu-check lock clean

setup:  ## install everything into .venv/ (CPU mode unless a GPU is found; SETUP_ARGS=--cuda|--cpu|--no-smollm2)
	bash scripts/setup.sh $(SETUP_ARGS)

test:  ## the CPU test suite (unit + real SGLang integration tests), on TEST_WORKERS processes
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast:  ## the suite without the slow integration tests
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not gpu"

lint:  ## ruff, and the import contracts of pyproject.toml (docs/structure.md)
	$(PY) -m ruff check fineslab scheduler tests scripts
	bash scripts/lint_imports.sh

typecheck:
	bash scripts/typecheck.sh

check: lint typecheck test

gpu-check:  ## every GPU test and GPU benchmark, on a machine with a CUDA GPU
	bash scripts/gpu_check.sh

lock:  ## re-resolve requirements/cpu.lock from requirements/*.in (needs the registry)
	bash scripts/lock.sh

clean:
	rm -rf build .mypy_cache .ruff_cache .pytest_cache

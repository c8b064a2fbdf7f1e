"""Benchmarks, each runnable as `python -m fineslab.bench.<name> [--json]`.

Every benchmark measures fineslab against a baseline in the same run and prints a human table;
with `--json` it prints one JSON object as the last line (see `fineslab.bench.report`).
"""

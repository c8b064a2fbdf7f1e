"""The short version of `fineslab.bench.wake` (issue #16): llama-tiny, two sleep/wake cycles,
the host copy corrupted before the second wake. The first wake restores output bit for bit
(identical), the second must not (the negative control of `identical`), and the figures are
printed with a JSON line last. The full run (300 MB model, cold start) is in docs/elastic.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_wake_bench_restores_identically_and_its_negative_control_fails() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fineslab.bench.wake", "--size", "tiny", "--cycles", "2",
         "--skip-cold", "--corrupt-host-copy", "--json"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["identical_per_cycle"] == [True, False], result
    assert result["identical"] is False
    assert result["weights_gib"] > 0 and result["wake_s"] > 0 and result["restore_s"] > 0
    assert "cold_over_wake" not in result

"""The short version of `fineslab.bench.streaming` (issue #17): llama-tiny (4 layers), S empty
then Select-N intervals 2 and 4, with the host copy corrupted after S empty is measured. The
arena's gain equals the lent bytes at every interval, S empty's output is the reference, and
every streamed interval must come out not identical (the negative control of `identical`: the
streamed layers are read from the host copy). The full run is in docs/streaming.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_streaming_bench_gains_the_lent_bytes_and_its_negative_control_fails() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fineslab.bench.streaming", "--size", "tiny", "--tokens", "4",
         "--corrupt-host-copy", "--json"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    intervals = result["intervals"]
    assert sorted(intervals) == ["2", "4", "none"], "an interval wider than 4 layers is skipped"
    assert intervals["2"]["layers"] == [1, 3] and intervals["4"]["layers"] == [3]
    assert result["kv_gain_equals_lent"] is True
    assert intervals["2"]["kv_gain_bytes"] > 0, "two layers through one slot: one layer gained"
    assert intervals["4"]["kv_gain_bytes"] == 0, "one layer through one slot: nothing gained"
    assert intervals["none"]["identical"] is True
    assert intervals["2"]["identical"] is False and intervals["4"]["identical"] is False
    assert result["identical_all"] is False
    assert result["copy_gib_s"] > 0 and result["memcpy_gib_s"] > 0

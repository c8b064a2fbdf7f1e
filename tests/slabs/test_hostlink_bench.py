"""bench.hostlink on CPU (the short version; the GPU run is in scripts/gpu_check.sh): the
restore path it times is the wake's own, its bytes are checked, and a restore that copies
nothing is caught (the negative control of `verified`)."""

from __future__ import annotations

import json

import pytest

from fineslab.bench import hostlink
from fineslab.slabs import weights


def test_hostlink_bench_reports_the_restore_against_memcpy(
        capsys: pytest.CaptureFixture[str]) -> None:
    hostlink.main(["--device", "cpu", "--mib", "16", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["verified"] is True
    assert result["memcpy_gib_s"] > 0 and result["restore_gib_s"] > 0
    ratio = result["restore_over_memcpy_spread"]
    assert ratio["n"] == result["rounds"] == 5, "the median of five interleaved rounds"
    assert ratio["min"] <= result["restore_over_memcpy"] == ratio["median"] <= ratio["max"]
    assert result["memcpy_gib_s_spread"]["min"] <= result["memcpy_gib_s"]
    assert "overlap" not in result, "the copy-stream overlap is a GPU figure"


def test_hostlink_bench_catches_a_restore_that_copies_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "copy_file_into", lambda path, dst: None)
    result = hostlink.run("cpu", 1 << 20, 1 << 20)
    assert result["verified"] is False


def test_hostlink_bench_refuses_a_size_below_one_mib() -> None:
    with pytest.raises(SystemExit, match="must be >= 1"):
        hostlink.main(["--mib", "0"])

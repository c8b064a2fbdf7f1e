"""`apply_request`: a stream request written, then the runtime's state waited for (its seq)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fineslab.slabs.streamctl import (
    StreamState,
    apply_request,
    read_request,
    request_path,
    state_path,
    write_state,
)


def _runtime(folder: Path, error: str | None) -> threading.Thread:
    """A stand-in runtime: answers the first request it reads with its state."""
    def answer() -> None:
        path = request_path("a", "m", folder)
        for _ in range(500):
            request = read_request(path)
            if request is not None:
                write_state(state_path("a", "m", folder),
                            StreamState(seq=request.seq, layers=list(request.layers),
                                        error=error))
                return
            time.sleep(0.01)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_the_state_of_the_applied_request_is_returned(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path, None)
    state = apply_request("a", "m", (3, 1), folder=tmp_path)
    runtime.join()
    assert state.layers == [1, 3] and state.seq == 0


def test_a_refused_request_raises_with_the_runtimes_reason(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path, "no such layer 9")
    with pytest.raises(RuntimeError, match="refused: no such layer 9"):
        apply_request("a", "m", (9,), folder=tmp_path)
    runtime.join()


def test_a_request_no_runtime_applies_times_out(tmp_path: Path) -> None:
    start_s = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not apply stream request \[1\] in 0.3 s"):
        apply_request("a", "m", (1,), timeout_s=0.3, folder=tmp_path)
    assert time.monotonic() - start_s < 5

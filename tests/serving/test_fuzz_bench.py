"""`python -m fineslab.bench.fuzz` in short (issue #15): hostile and drawn bodies at the router
get no 5xx and break no connection; its negative control fuzzes a backend with no router in
front, which does answer 500s, so the bench can tell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fineslab.router.testing import start_echo_backend
from fineslab.runtime import free_port

REPO = Path(__file__).resolve().parents[2]


def _fuzz(*args: str) -> tuple[int, dict[str, object], str]:
    done = subprocess.run([sys.executable, "-m", "fineslab.bench.fuzz", "--json", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    out = done.stdout + done.stderr
    assert done.stdout.strip(), f"the bench printed nothing (rc {done.returncode}):\n{out[-3000:]}"
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1]), out


def test_fuzzing_the_router_finds_no_server_error_nor_reset() -> None:
    code, result, out = _fuzz("--cases", "200", "--seed", "1")
    assert (result["server_errors"], result["resets"], result["bad_error_shape"]) == (0, 0, 0), out
    assert result["health_ok"] is True and code == 0, out
    assert result["cases"] >= 200
    statuses = result["statuses"]
    assert isinstance(statuses, dict) and statuses.get("200", 0) > 0, "some cases are served"
    assert statuses.get("413") == 1 and statuses.get("405", 0) >= 1, statuses


def test_negative_control_a_backend_without_the_router_fails_the_fuzz() -> None:
    port = free_port()
    backend = start_echo_backend(port)
    try:
        code, result, out = _fuzz("--cases", "40", "--target", f"http://127.0.0.1:{port}")
    finally:
        backend.terminate()
        backend.wait(10)
    assert code == 1, out
    assert int(result["server_errors"]) > 0 and result["health_ok"] is False, out  # type: ignore[call-overload]


def test_every_drawn_body_that_could_be_served_asks_for_a_short_answer() -> None:
    # A long run's client timeouts were chat bodies with `max_tokens: null`, which a runtime
    # answers up to the context: minutes of generation on CPU. Every drawn JSON object must
    # carry a max_tokens that is short, or one the router refuses (wrong type, out of range).
    from fineslab.bench.fuzz_cases import MAX_NEW_TOKENS, random_cases

    context = 2048
    bodies = []
    for _, _, raw in random_cases(["m"], {"m": context}, 400, seed=3):
        try:
            body = json.loads(raw)
        except ValueError:
            continue
        if isinstance(body, dict) and set(body) & {"prompt", "messages"}:
            bodies.append(body)
    assert len(bodies) > 200, "most draws are request bodies"
    long_ones = [b["max_tokens"] for b in bodies
                 if b.get("max_tokens") is None or (
                     isinstance(b["max_tokens"], int) and not isinstance(b["max_tokens"], bool)
                     and MAX_NEW_TOKENS < b["max_tokens"] <= context)]
    assert long_ones == [], f"bodies that would generate long answers: {long_ones[:5]}"

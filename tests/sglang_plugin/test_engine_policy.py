"""Algorithm 2 inside a real CPU SGLang server (issue #18, item 1): `FINESLAB_ENGINE_POLICY`.

Two llama-tiny servers, started together: "arena" keeps its KV in a slab arena (the policy rides
on the arena's plugin session) and "plain" keeps SGLang's own pool (the policy's own session).
Both prefill in chunks of 64 tokens. Their profile pretends a 64-token chunk takes 1 s, so
that the work ahead of a request (a long prompt being prefilled) outweighs a short request's
own prefill by far; the SLO is 3 s. "arena" decides with that profile as given (refresh off);
"plain" refreshes it from the prefill steps it times (`step_refresh.py`), so there the same
work ahead is predicted at the speed this machine runs it. Deadlines go in SGLang's `priority`
field, in wall-clock milliseconds, as the router sends them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fineslab.scheduler.local import ENGINE_DROP_PREFIX
from fineslab.scheduler.refreshed import MIN_SAMPLES, FollowedPredictor, read_scales
from plugin_test_support import arena_for, kv_shape, prompts

from fineslab.runtime import ServerProcess, ServerSpec, free_port
from fineslab.sglang_plugin.config import EngineSchedule

pytestmark = pytest.mark.slow

CHUNK = 64
SCHEDULE = EngineSchedule("adaptive", 3.0, CHUNK, ((0.0, 0.0), (float(CHUNK), 1.0)))
LONG_TOKENS = 3000
PREDICTED = re.compile(r"would take about ([0-9.]+) s")
BEHIND = re.compile(r"behind ([0-9]+) prompt tokens")


@pytest.fixture(scope="module")
def servers(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("engine")
    arena = arena_for([kv_shape("llama-tiny", "bfloat16", "arena")], 16, 1 << 20, 16)
    envs = {"arena": {**arena.join("arena").environ(),
                      **dataclasses.replace(SCHEDULE, refresh=False).environ()},
            "plain": dataclasses.replace(
                SCHEDULE, publish=str(logs / "plain.steps.json")).environ()}
    procs = {}
    try:
        for name, env in envs.items():
            args = ("--dtype", "bfloat16", "--chunked-prefill-size", str(CHUNK),
                    *(("--page-size", "16") if name == "arena" else
                      ("--max-total-tokens", "8192")))
            spec = ServerSpec(str(model_cache / "llama-tiny"), free_port(), extra_args=args,
                              env=env)
            procs[name] = ServerProcess(spec, logs / f"{name}.log")
        for proc in procs.values():
            proc.wait_healthy(300)
        yield {**{name: proc.spec.base_url for name, proc in procs.items()},
               "plain_scales": str(logs / "plain.steps.json")}
    finally:
        for proc in procs.values():
            proc.stop()
        arena.close()


def _completion(base_url: str, prompt: list[int], priority: object = None, stream: bool = False,
                max_tokens: int = 4) -> httpx.Response:
    body: dict[str, object] = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                               "stream": stream}
    if priority is not None:
        body["priority"] = priority
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def _deadline_ms(in_s: float) -> int:
    return int((time.time() + in_s) * 1000)


@pytest.mark.parametrize("runtime", ["arena", "plain"])
def test_a_request_past_its_deadline_gets_429_and_the_runtime_keeps_serving(
        servers: dict[str, str], runtime: str) -> None:
    url = servers[runtime]
    prompt = prompts(1, 8, seed=1)[0]
    whole = _completion(url, prompt, priority=_deadline_ms(-5.0))
    assert whole.status_code == 429, whole.text
    assert whole.json()["message"].startswith(ENGINE_DROP_PREFIX)
    assert "deadline passed" in whole.json()["message"]
    streamed = _completion(url, prompt, priority=_deadline_ms(-5.0), stream=True)
    assert ENGINE_DROP_PREFIX in streamed.text and '"code": 429' in streamed.text
    served = _completion(url, prompt, priority=_deadline_ms(60.0))
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("priority", [None, 0, -7, 2**62, 1])
def test_a_request_without_a_plausible_deadline_gets_the_model_slo(
        servers: dict[str, str], priority: object) -> None:
    """No priority, or one that is no deadline (a client's own number, far from now): the
    request's deadline is its arrival + the SLO, so it is served, never dropped at once."""
    response = _completion(servers["plain"], prompts(1, 8, seed=2)[0], priority=priority)
    assert response.status_code == 200, response.text


def _short_requests_during_a_long_prefill(url: str) -> list[httpx.Response]:
    """Short one-token requests (deadline 3 s) sent one after another while a 3,000-token
    prompt is prefilled; the answers."""
    return [answer for _, answer in _timed_short_requests(url)[0]]


def _timed_short_requests(url: str) -> tuple[list[tuple[float, httpx.Response]], float, float]:
    """`_short_requests_during_a_long_prefill` with each answer's send time, and the times the
    long prompt was sent and its answer came (time.monotonic)."""
    short = prompts(1, 8, seed=3)[0]
    start_s = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        long = pool.submit(_completion, url, prompts(1, LONG_TOKENS, seed=4)[0],
                           _deadline_ms(600.0), False, 1)
        long.add_done_callback(lambda _: done_at.append(time.monotonic()))
        done_at: list[float] = []
        # The short ones ask for one token: a short request let in before the long one would
        # otherwise wait for its decode steps, which SGLang runs only after every chunk.
        time.sleep(0.3)
        answers = []
        while not long.done() and len(answers) < 200:
            sent = time.monotonic()
            answers.append((sent, _completion(url, short, priority=_deadline_ms(3.0),
                                              max_tokens=1)))
            time.sleep(0.02)
        assert long.result().status_code == 200, long.result().text
    assert {a.status_code for _, a in answers} <= {200, 429}
    return answers, start_s, done_at[0] if done_at else time.monotonic()


def test_a_short_request_behind_a_long_prefill_is_dropped_naming_the_work_ahead(
        servers: dict[str, str]) -> None:
    """Alone, 8 tokens would be prefilled in 0.125 s (the profile's), well within 3 s; behind
    the 3,000-token prompt being prefilled (47 chunks, 'about 47 s') they cannot be. SGLang's
    own admission would take them at the next step; the engine policy drops them at once,
    saying why. Once the long prompt is done, the same request is served."""
    url = servers["arena"]
    answers = _short_requests_during_a_long_prefill(url)
    dropped = [a for a in answers if a.status_code == 429]
    assert dropped, f"no short request was dropped in {len(answers)} tries during the prefill"
    assert all(ENGINE_DROP_PREFIX in a.json()["message"] for a in dropped)
    assert any("prompt tokens already being prefilled" in a.json()["message"] for a in dropped)
    # The profile as given: 1 s a 64-token chunk, whatever this machine takes (40-260 ms a
    # chunk idle, more under load). How many chunks are left at the first drop depends on
    # the machine; the pace of each prediction does not.
    paced = [(float(m.group(1)), int(b.group(1))) for a in dropped
             for m, b in [(PREDICTED.search(a.json()["message"]),
                           BEHIND.search(a.json()["message"]))] if m and b]
    assert paced, [a.json()["message"] for a in dropped]
    assert all(seconds >= 0.9 * ahead / CHUNK for seconds, ahead in paced), paced
    short = prompts(1, 8, seed=3)[0]
    assert _completion(url, short, priority=_deadline_ms(3.0), max_tokens=1).status_code == 200


def test_a_refreshed_profile_predicts_the_work_ahead_at_this_machines_speed(
        servers: dict[str, str]) -> None:
    """The same scenario on "plain", whose profile (1 s a chunk, tens of times too slow here)
    is refreshed from the chunks it times: once the long prompt's first MIN_SAMPLES chunks
    are timed, the chunk's own scale decides (whatever the steps of other sizes before them
    said), so a short request is dropped only if the machine itself is that slow, and any drop
    names a predicted wait near the work that was really left: at most twice the time until
    the long prompt's answer came, plus 2 s (on an idle machine a chunk takes 40-260 ms, so
    about 12 s at most; on a machine loaded by other work, more, and the prediction follows).
    The "arena" test above, refresh off, is the control: there the early drops predict tens
    of seconds, the profile's 1 s a chunk, whatever the machine does."""
    timed, start_s, done_s = _timed_short_requests(servers["plain"])
    answers = [answer for _, answer in timed]
    late = [(seconds, round(done_s - sent, 2)) for sent, a in timed if a.status_code == 429
            for m in [PREDICTED.search(a.json()["message"])] if m
            for b in [BEHIND.search(a.json()["message"])]
            if b and LONG_TOKENS - int(b.group(1)) >= MIN_SAMPLES * CHUNK
            for seconds in [float(m.group(1))] if seconds > 2.0 * (done_s - sent) + 2.0]
    assert late == [], f"(predicted s, really left s) of drops predicted far too late: {late}"
    predicted = [float(m.group(1)) for a in answers if a.status_code == 429
                 for m in [PREDICTED.search(a.json()["message"])] if m]
    assert any(a.status_code == 200 for a in answers) or predicted, "no answer at all"
    # One predictor: the router's gate, following the file the runtime writes, scales the
    # profile's 1 s chunk to this machine's speed, as the runtime does (a 64-token chunk took
    # 40-260 ms here on an idle machine, later chunks of a long prompt the longest): near the
    # pace the long prompt was really prefilled at, not the profile's.
    pace_s = (done_s - start_s) / -(-LONG_TOKENS // CHUNK)
    scales = Path(servers["plain_scales"])
    deadline = time.monotonic() + 5
    while (doc := read_scales(scales)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert doc is not None and doc["overall"][1] > 0, "the runtime wrote its step scales"
    chunk_s = FollowedPredictor(SCHEDULE.predictor(), (scales,)).current().step_s(CHUNK)
    assert pace_s / 3 <= chunk_s <= 2 * pace_s + 0.05, (
        f"the gate predicts a chunk at {chunk_s:.3f} s; the long prompt's chunks took "
        f"{pace_s:.3f} s each (the profile says 1 s)")

"""Elastic models end to end (issue #16): `examples/cpu-elastic.yaml` launched for real, three
SGLang runtimes with their weights in one slab arena, the router's admin API and `fineslab ctl`.

    llama-a       idle_timeout_s 3   (sleeps on its own during the tests)
    qwen-b        idle_timeout_s 600 (starts asleep: the device's weights_arena_mib holds two
                                      models awake; then sleeps only when asked or evicted)
    llama-pinned  pinned             (never idles to sleep, never evicted)

Arena pressure comes from the test itself: a `WeightRegion` of the test process (a real owner in
the fleet's slab table) takes every free slab, the way another model's weights would. The checks
run in file order against one fleet; the last one stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleet_support import (
    REPO,
    Hog,
    LaunchedFleet,
    assert_no_slab_leaked,
    group_alive,
    launched,
    shm_files,
)

from fineslab.slabs import SlabArena, snapshot

pytestmark = pytest.mark.slow

IDLE_S = 3.0


def _edit(config: dict[str, Any]) -> None:
    for model in config["models"]:
        if model["name"] == "llama-a":
            model["idle_timeout_s"] = IDLE_S
        elif model["name"] == "qwen-b":
            model["idle_timeout_s"] = 600


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[LaunchedFleet]:
    folder = tmp_path_factory.mktemp("elastic-fleet")
    with launched("cpu-elastic.yaml", folder, model_cache, f"elastic-{os.getpid()}",
                  signal.SIGTERM, edit=_edit) as (running, _):
        yield running


def _ctl(fleet: LaunchedFleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fineslab.ctl", "--url", fleet.base_url, *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def _states(fleet: LaunchedFleet) -> dict[str, dict[str, Any]]:
    reply = httpx.get(fleet.base_url + "/admin/models", timeout=30)
    assert reply.status_code == 200, reply.text
    return {m["model"]: m for m in reply.json()["models"]}


def _complete(fleet: LaunchedFleet, model: str) -> httpx.Response:
    return httpx.post(fleet.base_url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": "the slab arena", "max_tokens": 8, "temperature": 0})


def _text(fleet: LaunchedFleet, model: str) -> str:
    reply = _complete(fleet, model)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _wait_state(fleet: LaunchedFleet, model: str, state: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _states(fleet)[model]["state"] != state:
        assert time.monotonic() < deadline, f"{model} not {state}: {_states(fleet)[model]}"
        time.sleep(0.5)


def _weight_slabs_held(fleet: LaunchedFleet, runtime_id: str) -> int:
    with SlabArena.attach(fleet.fleet_id, "cpu:0") as arena:
        owners = {o.runtime_id: o for o in snapshot(arena.table).owners}
    owner = owners.get(f"{runtime_id}:w")
    return owner.num_slabs if owner is not None else 0


def _serves_again(fleet: LaunchedFleet, model: str) -> None:
    """Retry `model` until it answers 200 (at most 300 s). 502 in the half second before the
    supervisor sees a death, then 503 until the restart serves: the documented codes of a dead
    runtime; anything else fails."""
    deadline = time.monotonic() + 300
    while (reply := _complete(fleet, model)).status_code != 200:
        assert reply.status_code in (502, 503) and time.monotonic() < deadline, \
            (reply.text, fleet.output.read_text()[-3000:])
        time.sleep(2)


def test_a_model_the_arena_does_not_hold_awake_starts_asleep_and_its_first_request_wakes_it(
        fleet: LaunchedFleet) -> None:
    out = fleet.output.read_text()
    assert "runtime qwen-b-r0 asleep:" in out, out[-3000:]
    state = _states(fleet)["qwen-b"]
    assert state["state"] == "asleep" and state["weight_slabs"] >= 1, state
    assert _states(fleet)["llama-a"]["state"] == "awake"
    assert _weight_slabs_held(fleet, "qwen-b-r0") == 0
    assert _text(fleet, "qwen-b")
    assert _states(fleet)["qwen-b"]["state"] == "awake"


def test_an_idle_model_sleeps_and_a_request_wakes_it_with_the_same_output(
        fleet: LaunchedFleet) -> None:
    before = _text(fleet, "llama-a")
    assert _weight_slabs_held(fleet, "llama-a-r0") > 0, "awake: its weights are in the arena"
    _wait_state(fleet, "llama-a", "asleep", timeout_s=IDLE_S + 30)
    assert _weight_slabs_held(fleet, "llama-a-r0") == 0, "asleep: its weight slabs are free"
    assert _text(fleet, "llama-a") == before, "greedy output after the wake equals before"
    state = _states(fleet)["llama-a"]
    assert state["state"] == "awake" and state["wakes"] >= 1 and state["sleeps"] >= 1, state
    metrics = fleet.metrics()
    assert 'fineslab_model_state{model="llama-a",state="awake"} 1.0' in metrics
    assert 'fineslab_wake_seconds_count{model="llama-a"}' in metrics


def _flush_awake_caches(fleet: LaunchedFleet) -> None:
    """Every awake runtime's prefix cache dropped, so the hog takes the slabs they held: else
    the cache reclaimer, seeing the waking request pressed, may flush one and make the room an
    eviction was to make (a rehearsal of the suite on a loaded machine did)."""
    states = _states(fleet)
    for model, replicas in fleet.health()["models"].items():
        if states.get(model, {}).get("state", "awake") != "awake":
            continue
        for replica in replicas:
            deadline = time.monotonic() + 30
            # 400 while the runtime has work: the supervisor's liveness probe is a request too
            while httpx.post(replica["url"] + "/flush_cache", timeout=30).status_code != 200:
                assert time.monotonic() < deadline, replica
                time.sleep(0.2)


def test_a_wake_without_room_puts_the_least_recently_used_idle_model_to_sleep(
        fleet: LaunchedFleet) -> None:
    assert _ctl(fleet, "sleep", "llama-a").returncode == 0
    _text(fleet, "qwen-b")  # awake and idle; the pinned model is never evicted
    need = _states(fleet)["llama-a"]["weight_slabs"]
    assert need > 1 and _states(fleet)["qwen-b"]["weight_slabs"] >= 1
    _flush_awake_caches(fleet)
    # One slab short of llama-a's weights: qwen-b's make room.
    hog = Hog(fleet, leave=need - 1)
    try:
        assert _text(fleet, "llama-a"), "served after qwen-b was put to sleep for it"
        states = _states(fleet)
        assert states["qwen-b"]["state"] == "asleep" and states["qwen-b"]["evictions"] == 1, \
            states["qwen-b"]
        assert states["llama-pinned"]["state"] == "awake", states["llama-pinned"]
    finally:
        hog.close()


def test_a_wake_with_nothing_to_evict_gets_503_with_the_reason_and_serves_once_room_frees(
        fleet: LaunchedFleet) -> None:
    assert _ctl(fleet, "sleep", "llama-a").returncode == 0
    hog = Hog(fleet)
    try:
        reply = _complete(fleet, "qwen-b")
        assert reply.status_code == 503 and reply.headers.get("retry-after"), reply.text
        message = reply.json()["error"]["message"]
        assert "cannot wake" in message and "pinned" in message, message
        woke = _ctl(fleet, "wake", "qwen-b")
        assert woke.returncode == 1 and "503" in woke.stderr, woke
        assert _states(fleet)["qwen-b"]["state"] == "asleep"
    finally:
        hog.close()
    assert _text(fleet, "qwen-b"), "the same request is served once the arena has room"


def test_a_pinned_model_stays_awake_when_idle_and_ctl_sleeps_and_wakes_it(
        fleet: LaunchedFleet) -> None:
    state = _states(fleet)["llama-pinned"]
    assert state["state"] == "awake" and state["idle_for_s"] > IDLE_S, state
    slept = _ctl(fleet, "sleep", "llama-pinned")
    assert slept.returncode == 0 and "llama-pinned: asleep" in slept.stdout, slept
    woke = _ctl(fleet, "wake", "llama-pinned")
    assert woke.returncode == 0 and "llama-pinned: awake" in woke.stdout, woke
    listed = _ctl(fleet, "list")
    assert listed.returncode == 0 and "pinned" in listed.stdout, listed
    unknown = _ctl(fleet, "sleep", "no-such-model")
    assert unknown.returncode == 1 and "404" in unknown.stderr, unknown
    bad = httpx.post(fleet.base_url + "/admin/models/qwen-b/explode", timeout=30)
    assert bad.status_code == 404 and "sleep, wake or limit" in bad.json()["error"]["message"]


def test_ctl_limit_caps_a_models_kv_in_the_slab_table_and_refuses_what_cannot_be_a_limit(
        fleet: LaunchedFleet) -> None:
    done = _ctl(fleet, "limit", "llama-pinned", "3M")
    assert done.returncode == 0 and "KV limit 3.00 MiB" in done.stdout, done
    with SlabArena.attach(fleet.fleet_id, "cpu:0") as arena:
        assert arena.table.kv_limits() == {"llama-pinned-r0": 3 << 20}, "kept by runtime id"
    assert "3.00 MiB" in _ctl(fleet, "list").stdout
    metrics = httpx.get(fleet.base_url + "/metrics", timeout=30).text
    line = next(m for m in metrics.splitlines() if m.startswith(
        "fineslab_slab_owner_kv_limit_bytes") and "llama-pinned-r0" in m)
    assert float(line.split()[-1]) == 3 << 20, line
    assert _text(fleet, "llama-pinned"), "a short request fits in the limit"
    # 3,000 tokens need 6 MiB of FP16 llama-tiny KV: under the 3 MiB limit it would wait in
    # SGLang's queue for ever (bench.capacity's static partitions), so it is refused at once.
    long = {"model": "llama-pinned", "prompt": [11] * 3000, "max_tokens": 4}
    refused = httpx.post(fleet.base_url + "/v1/completions", json=long, timeout=30)
    assert refused.status_code == 400 and "KV limit" in refused.json()["error"]["message"], \
        refused.text
    below = _ctl(fleet, "limit", "llama-pinned", "1K")
    assert below.returncode == 1 and "400" in below.stderr and "below one slab" in below.stderr
    unknown = _ctl(fleet, "limit", "no-such-model", "1G")
    assert unknown.returncode == 1 and "404" in unknown.stderr, unknown
    for body in (b"{", b'{"kv_bytes": -5}', b'{"kv_bytes": true}', b'{"kv": 1}', b"[]",
                 b'{"kv_bytes": 1000000000000000000000000000000}',
                 b'{"kv_bytes": 9223372036854775808}'):
        reply = httpx.post(fleet.base_url + "/admin/models/llama-pinned/limit", content=body,
                           timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_limit", \
            (body, reply.text)
    cleared = _ctl(fleet, "limit", "llama-pinned", "none")
    assert cleared.returncode == 0 and "KV limit - per runtime" in cleared.stdout, cleared
    served = httpx.post(fleet.base_url + "/v1/completions", json=long, timeout=120)
    assert served.status_code == 200, f"without the limit it is served: {served.text}"
    with SlabArena.attach(fleet.fleet_id, "cpu:0") as arena:
        assert arena.table.kv_limits() == {}


def test_top_shows_each_models_state_weights_and_kv(fleet: LaunchedFleet) -> None:
    assert _ctl(fleet, "sleep", "llama-a").returncode == 0
    done = subprocess.run([sys.executable, "-m", "fineslab.top", "--url", fleet.base_url,
                           "--once"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("llama-a", "llama-pinned", "qwen-b")}
    assert rows["llama-a"][2] == "asleep" and rows["llama-a"][3:5] == ["0", "B"], done.stdout
    assert rows["llama-pinned"][2] == "awake" and rows["llama-pinned"][4] == "MiB", done.stdout
    assert "cpu: arena" in done.stdout and "free" in done.stdout
    gone = subprocess.run([sys.executable, "-m", "fineslab.top", "--url",
                           "http://127.0.0.1:9", "--once"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert gone.returncode == 1 and "cannot reach the router" in gone.stderr, gone


def test_a_runtime_killed_during_its_wake_leaks_no_slab_and_serves_again(
        fleet: LaunchedFleet) -> None:
    """Asleep, then SIGSTOPped so that the wake a request starts hangs in SGLang's resume call,
    then SIGKILLed in the middle of that wake."""
    assert _ctl(fleet, "sleep", "llama-a").returncode == 0
    pid = fleet.runtime_pids()["llama-a-r0"]
    os.killpg(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        waking = pool.submit(_complete, fleet, "llama-a")
        deadline = time.monotonic() + 60
        while _states(fleet)["llama-a"]["state"] != "waking":
            assert time.monotonic() < deadline and not waking.done(), "the wake did not start"
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
        first = waking.result(timeout=300)
    assert first.status_code in (502, 503), first.text
    _serves_again(fleet, "llama-a")
    assert fleet.runtime_pids()["llama-a-r0"] != pid
    assert _states(fleet)["llama-a"]["state"] == "awake"
    assert_no_slab_leaked(fleet)


def test_a_runtime_killed_during_its_sleep_leaks_no_slab_and_serves_again(
        fleet: LaunchedFleet) -> None:
    """SIGSTOPped so that the sleep `ctl sleep` starts hangs in SGLang's pause call, then
    SIGKILLed in the middle of that sleep: the sleep fails with the reason, the runtime is
    restarted (awake), and its slabs are reclaimed."""
    assert _text(fleet, "llama-a"), "awake"
    pid = fleet.runtime_pids()["llama-a-r0"]
    os.killpg(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        sleeping = pool.submit(_ctl, fleet, "sleep", "llama-a")
        deadline = time.monotonic() + 60
        while _states(fleet)["llama-a"]["state"] != "sleeping":
            assert time.monotonic() < deadline and not sleeping.done(), "the sleep did not start"
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
        failed = sleeping.result(timeout=300)
    assert failed.returncode == 1, failed
    _serves_again(fleet, "llama-a")
    assert _states(fleet)["llama-a"]["state"] == "awake"
    assert_no_slab_leaked(fleet)


def test_a_runtime_that_dies_asleep_in_a_full_arena_makes_room_for_its_restart(
        fleet: LaunchedFleet) -> None:
    """A restart loads the weights at start and cannot wait for room like a wake: with the
    arena full, the idle neighbour qwen-b is put to sleep first. Without that the start fails
    ("do not fit the arena") at every back-off, for as long as the arena stays full."""
    assert _text(fleet, "qwen-b"), "qwen-b awake (then idle: the one model to evict)"
    if _states(fleet)["llama-a"]["state"] != "asleep":
        assert _ctl(fleet, "sleep", "llama-a").returncode == 0
    evictions = _states(fleet)["qwen-b"]["evictions"]
    for model in ("qwen-b", "llama-pinned"):  # no cached KV for the reclaimer to flush
        for replica in fleet.health()["models"][model]:
            assert httpx.post(replica["url"] + "/flush_cache", timeout=30).status_code == 200
    # qwen-b's 6 weight slabs + these 2: llama-a's 7 and one of KV, besides slab 0 (never
    # weights: a KV runtime parks it whole, so it is no KV room to count on)
    hog = Hog(fleet, leave=2)
    try:
        pid = fleet.runtime_pids()["llama-a-r0"]
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        # Requests only once the supervisor has seen the death: one before would try a wake,
        # whose own eviction would make the room (a path the wake tests cover).
        while fleet.health()["models"]["llama-a"][0]["state"] == "up":
            assert time.monotonic() < deadline, "the supervisor did not see the death"
            time.sleep(0.1)
        _serves_again(fleet, "llama-a")
    finally:
        hog.close()
    assert "making room for llama-a-r0" in fleet.output.read_text()
    qwen = _states(fleet)["qwen-b"]
    assert qwen["state"] == "asleep" and qwen["evictions"] == evictions + 1, qwen


def test_dry_run_says_which_models_sleep(fleet: LaunchedFleet) -> None:
    done = subprocess.run([sys.executable, "-m", "fineslab.launch", "--config",
                           str(REPO / "examples" / "cpu-elastic.yaml"), "--dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, FINESLAB_MODEL_CACHE=str(fleet.model_cache)))
    assert done.returncode == 0, done.stderr
    assert "idle 30 s" in done.stdout and "pinned" in done.stdout, done.stdout
    assert "idle 30 s, starts asleep" in done.stdout, done.stdout


def test_shutdown_leaves_no_process_no_shared_memory_and_no_host_copy(
        fleet: LaunchedFleet) -> None:
    pids = list(fleet.runtime_pids().values())
    copies = list(Path(tempfile.gettempdir()).glob(f"fineslab-{fleet.fleet_id}-weights-*"))
    assert copies, "the fleet keeps its sleeping models' host copies in a folder of its own"
    os.killpg(fleet.proc.pid, signal.SIGINT)
    assert fleet.proc.wait(120) == 0
    assert [p for p in [*pids, fleet.proc.pid] if group_alive(p)] == []
    assert shm_files(fleet.fleet_id) == []
    assert [c for c in copies if c.exists()] == [], "host copies are removed at stop"

"""Layer streaming end to end (issue #17): `examples/cpu-streaming.yaml` launched for real,
three llama-tiny runtimes (the same generated weights) in one slab arena.

    llama-selectn  selectn, interval 2: streams layers 1 and 3 from its first pass
    llama-lender   oneiros, cap 2: lends layers when the device runs out of KV while it idles
    llama-busy     a plain runtime: the borrower

KV pressure comes from the test itself: a `WeightRegion` of the test process (a real owner in
the fleet's slab table) takes every free slab, and llama-busy gets requests that need more KV
than it holds. The checks run in file order against one fleet.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleet_support import REPO, Hog, LaunchedFleet, assert_no_slab_leaked, launched

pytestmark = pytest.mark.slow

MODELS = ("llama-selectn", "llama-lender", "llama-busy")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[LaunchedFleet]:
    folder = tmp_path_factory.mktemp("streaming-fleet")
    with launched("cpu-streaming.yaml", folder, model_cache, f"streaming-{os.getpid()}",
                  signal.SIGTERM) as (running, _):
        yield running


def _models(fleet: LaunchedFleet) -> dict[str, dict[str, Any]]:
    reply = httpx.get(fleet.base_url + "/admin/models", timeout=30)
    assert reply.status_code == 200, reply.text
    return {m["model"]: m for m in reply.json()["models"]}


def _lent(fleet: LaunchedFleet, model: str) -> list[int]:
    streaming = _models(fleet)[model].get("streaming") or {}
    return [layer for state in streaming.values() for layer in state["layers"]]


def _wait_lent(fleet: LaunchedFleet, model: str, want: Any, timeout_s: float = 90) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not want(layers := _lent(fleet, model)):
        assert time.monotonic() < deadline, (model, layers, fleet.output.read_text()[-3000:])
        time.sleep(0.5)
    return layers


def _complete(fleet: LaunchedFleet, model: str, prompt: str, max_tokens: int
              ) -> httpx.Response:
    return httpx.post(fleet.base_url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def _text(fleet: LaunchedFleet, model: str, prompt: str = "the slab arena") -> str:
    reply = _complete(fleet, model, prompt, 16)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _burst(fleet: LaunchedFleet, model: str) -> None:
    """Four requests at once to `model`, each needing more KV than an arena the hog holds has
    to spare; every one must be answered."""
    prompt = " ".join(f"word{i}" for i in range(150))
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: _complete(fleet, model, prompt, 200), range(4)))
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]


def _flush_caches(fleet: LaunchedFleet) -> None:
    """Every runtime's prefix cache dropped (SGLang's /flush_cache), so the slabs they held are
    free for the hog: an idle neighbour's cache is the launcher's first source of room, before
    any layer is lent (a CI run's burst found 3 cached slabs of llama-busy and lent nothing)."""
    for replicas in fleet.health()["models"].values():
        for replica in replicas:
            deadline = time.monotonic() + 30
            # 400 while the runtime has work: the supervisor's liveness probe is a request too
            while (reply := httpx.post(replica["url"] + "/flush_cache", timeout=30)
                   ).status_code != 200:
                assert time.monotonic() < deadline, (replica, reply.text)
                time.sleep(0.5)


def test_selectn_streams_from_the_start_with_the_output_of_a_model_that_does_not(
        fleet: LaunchedFleet) -> None:
    assert _wait_lent(fleet, "llama-selectn", lambda layers: layers) == [1, 3]
    # its runtime contract names the control files it shares with the launcher, in use
    contract = json.loads((fleet.output.parent / "logs" / "llama-selectn-r0.contract.json")
                          .read_text())
    files = contract["files"]
    assert set(files) == {"weights_host_copy", "stream_request", "stream_state"}, contract
    assert all(Path(p).is_file() for p in files.values()), files
    assert _lent(fleet, "llama-lender") == [] and _lent(fleet, "llama-busy") == []
    busy = _text(fleet, "llama-busy")
    assert _text(fleet, "llama-selectn") == busy, "same weights, same greedy text"
    assert _text(fleet, "llama-lender") == busy


def test_an_idle_model_lends_layers_to_a_neighbour_out_of_kv_and_takes_them_back(
        fleet: LaunchedFleet) -> None:
    before = _text(fleet, "llama-lender")
    _flush_caches(fleet)
    hog = Hog(fleet)
    try:
        _burst(fleet, "llama-busy")
        lent = _lent(fleet, "llama-lender")
        assert 1 <= len(lent) <= 2, f"llama-lender lent {lent} (cap 2) while the hog held"
        log = fleet.output.read_text()
        assert "oneiros: " in log and "lent to the arena" in log, log[-3000:]
    finally:
        hog.close()
    _wait_lent(fleet, "llama-lender", lambda layers: layers == [])
    assert _text(fleet, "llama-lender") == before, "greedy output after lending and reversion"
    assert "taken back" in fleet.output.read_text()


def test_an_active_model_out_of_kv_lends_its_own_layers_and_takes_them_back(
        fleet: LaunchedFleet) -> None:
    """llama-lender itself busy and out of KV (the hog holds every free slab): the only oneiros
    model is active, so it lends what its decode pass (timed by its streamer) can take in
    copies, a tenth of it here (synchronous copies on CPU), or, once the arena has stalled
    for a few rounds with nothing lent (copies timed on a loaded machine may fit no tenth:
    a CI run waited for ever), up to its cap; its requests finish with its own lent layers as
    KV, and the layers come back once it is done."""
    before = _text(fleet, "llama-lender")
    _flush_caches(fleet)
    hog = Hog(fleet)
    try:
        _burst(fleet, "llama-lender")
        log = fleet.output.read_text()
        lent = [int(line.split("lends while active: ")[1].split()[0]) for line in
                log.splitlines() if "oneiros: llama-lender-r0 lends while active: " in line]
        assert lent and all(1 <= n <= 2 for n in lent), (lent, log[-3000:])
    finally:
        hog.close()
    _wait_lent(fleet, "llama-lender", lambda layers: layers == [])
    assert _text(fleet, "llama-lender") == before, "greedy output after lending and reversion"


def test_ctl_list_and_metrics_show_the_layers_lent(fleet: LaunchedFleet) -> None:
    listed = subprocess.run([sys.executable, "-m", "fineslab.ctl", "--url", fleet.base_url,
                             "list"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("llama-selectn"))
    assert "[1, 3]" in row, listed.stdout
    metrics = httpx.get(fleet.base_url + "/metrics", timeout=30).text
    assert 'fineslab_stream_layers{model="llama-selectn",runtime="llama-selectn-r0"} 2.0' \
        in metrics, metrics[-2000:]
    assert "fineslab_stream_streamed_bytes_total" in metrics
    timed = re.search(r'fineslab_stream_decode_compute_seconds{model="llama-lender",'
                      r'runtime="llama-lender-r0"} (\S+)', metrics)
    assert timed and float(timed.group(1)) > 0, "the lender timed its decode passes above"


def test_a_lender_stopped_with_layers_lent_is_restarted_and_the_borrower_keeps_serving(
        fleet: LaunchedFleet) -> None:
    """SIGSTOP of llama-lender while llama-busy runs on its lent layers' slabs: the borrower's
    requests all finish (the lent slabs are the arena's, not the stopped process's), the
    supervisor's liveness probes find the lender hung and restart it, its dead owner's slabs
    are reclaimed, and it serves its greedy text again with its layers taken back."""
    before = _text(fleet, "llama-lender")
    restarts = fleet.output.read_text().count("restarting runtime llama-lender-r0")
    _flush_caches(fleet)
    hog = Hog(fleet)
    stopped: int | None = None
    try:
        prompt = " ".join(f"word{i}" for i in range(150))
        with ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(_complete, fleet, "llama-busy", prompt, 200) for _ in range(4)]
            _wait_lent(fleet, "llama-lender", lambda layers: layers)
            stopped = fleet.runtime_pids()["llama-lender-r0"]
            os.killpg(stopped, signal.SIGSTOP)
            replies = [f.result() for f in busy]
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    finally:
        hog.close()
    deadline = time.monotonic() + 300
    while (reply := _complete(fleet, "llama-lender", "the slab arena", 16)).status_code != 200:
        # 502/503 while it is found hung and restarted; 504 for a request it held when stopped
        assert reply.status_code in (502, 503, 504) and time.monotonic() < deadline, \
            (reply.text, fleet.output.read_text()[-3000:])
        time.sleep(2)
    assert reply.json()["choices"][0]["text"] == before, "greedy output after the restart"
    log = fleet.output.read_text()
    assert log.count("restarting runtime llama-lender-r0") == restarts + 1, log[-3000:]
    assert stopped not in fleet.runtime_pids().values()
    _wait_lent(fleet, "llama-lender", lambda layers: layers == [])
    assert_no_slab_leaked(fleet)


def test_nothing_leaks(fleet: LaunchedFleet) -> None:
    assert_no_slab_leaked(fleet)

"""End to end: the CPU demo fleet launched by `python -m fineslab.launch`, real SGLang runtimes
in one slab arena, real HTTP. One fleet for the module (start: about 1-2 min on an idle 2-core
machine, several minutes when the machine is loaded); the checks run against it in file order
and the last one shuts it down.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from fleet_support import (
    REPO,
    START_TIMEOUT_S,
    LaunchedFleet,
    execute_notebook,
    group_alive,
    launched,
    shm_files,
)

from fineslab import cpu_mode
from fineslab.bench.sharegpt_mini import DATASET_FILE
from fineslab.env import CPU_MODE_VAR, SGLANG_CPU_ENGINE_VAR
from fineslab.proctree import running_routers, tree_pids_of_group

# The launcher's own zygote, as a user's fleet has (not the suite's: conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_zygote")]

MODELS = ("llama-bf16", "llama-small-fp16", "qwen2-bf16", "smollm2")
#: The tokenizer of each model, for sglang.bench_serving.
MODEL_DIRS = {"llama-bf16": "llama-tiny", "llama-small-fp16": "llama-small",
              "qwen2-bf16": "qwen2-tiny"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[LaunchedFleet]:
    folder = tmp_path_factory.mktemp("demo-fleet")
    with launched("cpu-demo.yaml", folder, model_cache, f"e2e-{os.getpid()}",
                  signal.SIGTERM) as (running, _):
        yield running


def test_launch_reports_progress_and_every_runtime_up(fleet: LaunchedFleet) -> None:
    out = fleet.output.read_text()
    assert "placement by mme" in out and re.search(r"\[4/4\] runtime .* healthy", out), out
    health = fleet.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert sorted(health.json()["models"]) == sorted(MODELS)
    # where `fineslab ctl` and `top` find the fleet without --url
    record = json.loads(Path(f"/dev/shm/fineslab-{fleet.fleet_id}.run").read_text())
    assert record["router"] == fleet.base_url, record
    assert running_routers()[fleet.fleet_id] == fleet.base_url
    # four runtimes on this machine's cores: each its share, not every core (torch's default)
    share = max(1, len(os.sched_getaffinity(0)) // len(MODELS))
    assert f"; {share} compute thread(s) each on CPU" in out, out[:3000]
    for runtime, group in fleet.runtime_pids().items():
        pids = tree_pids_of_group(group)
        assert pids, runtime
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={share}".encode() in environ, (runtime, pid)


@pytest.mark.parametrize("model", MODELS)
def test_openai_client_streaming_and_not_against_each_model(fleet: LaunchedFleet,
                                                            model: str) -> None:
    client = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key="unused", timeout=300)
    reply = client.completions.create(model=model, prompt="The fleet", max_tokens=6,
                                      temperature=0)
    assert reply.model == model and reply.choices[0].text
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, f"{model}: the stream carried text"


def test_the_readmes_first_request_is_answered_in_words(fleet: LaunchedFleet) -> None:
    """The README's first request, its body read from the README: SmolLM2-135M-Instruct,
    greedy, knows a fact. The control: the same body to a generated model (random weights)
    gets tokens, not the fact."""
    readme = (REPO / "README.md").read_text()
    found = re.search(r"/v1/chat/completions .* -d '(\{.*?\})'", readme, re.DOTALL)
    assert found, "the README's demo sends a chat request"
    body = json.loads(found.group(1))
    answers = {}
    # (the control with a token limit: random weights may never reach end-of-sequence)
    for asked in (body, {**body, "model": "llama-bf16", "max_tokens": 16}):
        reply = httpx.post(fleet.base_url + "/v1/chat/completions", json=asked, timeout=300)
        assert reply.status_code == 200, reply.text
        answers[asked["model"]] = reply.json()["choices"][0]["message"]["content"]
    assert body["model"] == "smollm2" and "Paris" in answers["smollm2"], answers
    assert "Paris" not in answers["llama-bf16"], f"the control, random weights: {answers}"


def test_runtimes_keep_their_kv_in_the_shared_arena(fleet: LaunchedFleet) -> None:
    metrics = fleet.metrics()
    owners = re.findall(r'fineslab_slab_owner_slabs\{device="cpu",owner="([^"]+)"\} (\S+)',
                        metrics)
    assert sorted(o for o, _ in owners) == sorted(f"{m}-r0" for m in MODELS), owners
    keys = set(re.findall(r'fineslab_slabs\{device="cpu",key="(\d+)",state="(?:PARTIAL|FULL)"',
                          metrics))
    assert len(keys) >= 2, f"models of different KV formats hold slabs of different keys: {keys}"


def _environ_without_cpu_mode(hf_home: Path) -> dict[str, str]:
    """Our environment as a user's shell has it: no stubs on the path, no CPU switches (the
    test session's conftest put them in), and an empty Hugging Face cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in (CPU_MODE_VAR, SGLANG_CPU_ENGINE_VAR, "PYTHONPATH")}
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and p != str(cpu_mode.STUBS_DIR)]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    env["HF_HOME"] = str(hf_home)
    return env


def test_sglang_bench_serving_runs_against_the_router(fleet: LaunchedFleet,
                                                      tmp_path: Path) -> None:
    """SGLang's own load generator through fineslab's wrapper, as docs/serving.md runs it
    against this fleet: the `random` dataset (prompts cut from ShareGPT text) without
    --dataset-path, from a shell without the CPU stubs. Guards issue #15: `No module named
    'torchvision'`, then a ShareGPT download. (One run: each costs a process that imports
    SGLang, about 25 s here; the router's path is the same for every model, and the openai
    client test above covers each one.)"""
    hf_home = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.bench.bench_serving", "--backend", "sglang-oai",
         "--base-url", fleet.base_url, "--model", "llama-bf16",
         "--tokenizer", str(fleet.model_cache / MODEL_DIRS["llama-bf16"]),
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
         "--random-range-ratio", "1.0", "--num-prompts", "8", "--request-rate", "4",
         "--output-file", str(tmp_path / "results.jsonl"), "--disable-tqdm"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=_environ_without_cpu_mode(hf_home))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert f"dataset_path='{DATASET_FILE}'" in out, "the shipped ShareGPT file was used"
    match = re.search(r"Successful requests:\s+(\d+)", out)
    assert match and int(match.group(1)) == 8, out[-3000:]
    assert re.search(r"Mean TTFT \(ms\):\s+[\d.]+", out), out[-2000:]
    assert not hf_home.exists() or not any(hf_home.rglob("*.json")), "nothing was downloaded"
    assert (tmp_path / "results.jsonl").stat().st_size > 0, "the client wrote its results"


def test_null_max_tokens_is_served_with_the_default(fleet: LaunchedFleet) -> None:
    """`max_tokens: null` got SGLang's 400 "Input should be a valid integer" twice over (#39
    finding 5); null is unset in the OpenAI API, and SGLang's default (16) applies."""
    reply = httpx.post(fleet.base_url + "/v1/completions", timeout=60, json={
        "model": "llama-bf16", "prompt": "the slab arena is", "max_tokens": None,
        "temperature": None})
    assert reply.status_code == 200, reply.text
    assert 0 < reply.json()["usage"]["completion_tokens"] <= 16


@pytest.mark.parametrize(("payload", "status"), [
    (b"{oops", 400),
    (json.dumps({"model": "llama-bf16"}).encode(), 400),
    (json.dumps({"model": "llama-bf16", "prompt": "word " * 5000}).encode(), 400),
    (json.dumps({"model": "gpt-17", "prompt": "hi"}).encode(), 404),
    # issue #15, defect 1: this id past the 2,048-token vocabulary killed the runtime
    (json.dumps({"model": "llama-bf16", "prompt": [1, 4096], "max_tokens": 2}).encode(), 400),
    # defect 3: valid JSON that gave 500 and reset the connection
    (b'{"model": "qwen2-bf16", "prompt": "\\ud800", "max_tokens": 2}', 400),
    (b'{"model": "qwen2-bf16", "prompt": "x", "n": ' + b"[" * 10000 + b"]" * 10000 + b"}", 400),
    # defect 9: these leaked `range() arg 3 must not be zero` and a pydantic dump
    (json.dumps({"model": "llama-bf16", "prompt": "hi", "n": 0}).encode(), 400),
    (json.dumps({"model": "llama-bf16", "prompt": "hi", "max_tokens": 0}).encode(), 400),
    (json.dumps({"model": "qwen2-bf16", "messages": [{"role": "wizard", "content": "hi"}],
                 "max_tokens": 2}).encode(), 400),
    # a runtime's own 400, in the router's error shape and with no path of SGLang's sources
    (json.dumps({"model": "llama-bf16", "prompt": "hi", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}
     ).encode(), 400),
])
def test_bad_requests_get_their_status_and_the_fleet_stays_healthy(
        fleet: LaunchedFleet, payload: bytes, status: int) -> None:
    path = "/v1/chat/completions" if b'"messages"' in payload else "/v1/completions"
    reply = httpx.post(fleet.base_url + path, content=payload, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}, error
    assert not re.search(r"/[\w.-]+/[\w.-]+/", error["message"]), "no file path leaks"
    health = fleet.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def test_metrics_report_queues_ttft_slo_and_slabs(fleet: LaunchedFleet) -> None:
    metrics = fleet.metrics()
    for model in MODELS:
        assert f'fineslab_queue_length{{model="{model}"}}' in metrics
        assert f'fineslab_ttft_seconds_count{{model="{model}"}}' in metrics
        assert f'fineslab_ttft_slo_attainment{{model="{model}"}}' in metrics
    assert 'fineslab_arena_free_bytes{device="cpu"}' in metrics


def _stream_until_error(base_url: str, model: str,
                        streaming: threading.Event | None = None) -> str:
    """Stream a long completion; `streaming` is set once its first chunk came."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300,
                           max_retries=0)
    try:
        stream = client.completions.create(model=model, prompt="Tell a long story",
                                           max_tokens=400, temperature=0, stream=True)
        for _ in stream:
            if streaming is not None:
                streaming.set()
    except openai.APIError as exc:
        return f"error: {exc}"
    return "completed"


def test_the_idle_benchmark_counts_every_process_of_the_fleet_by_kind(
        fleet: LaunchedFleet) -> None:
    """`python -m fineslab.bench.idle` against this fleet: each runtime's lifeline, server,
    scheduler and detokenizer, the zygote and the launcher, found and sampled (the figures
    themselves are in docs/serving.md, measured on an idle machine)."""
    done = subprocess.run([sys.executable, "-m", "fineslab.bench.idle", "--fleet-id",
                           fleet.fleet_id, "--seconds", "1", "--repeats", "2", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    runtimes = len(MODELS)
    assert figures["processes"] == {"launcher": 1, "lifeline": runtimes, "zygote": 1,
                                    "server": runtimes, "scheduler": runtimes,
                                    "detokenizer": runtimes, "other": 0}, figures
    for kind, share in figures["percent_of_one_core"].items():
        assert 0 <= share["min"] <= share["median"] <= share["max"] and share["n"] == 2, kind
    assert "window 2 of 2" in done.stderr
    missing = subprocess.run([sys.executable, "-m", "fineslab.bench.idle", "--fleet-id",
                              "no-such-fleet", "--seconds", "1"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "is it launched?" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr


def test_killing_a_runtime_mid_load_errors_its_requests_restarts_it_and_others_answer(
        fleet: LaunchedFleet) -> None:
    victim = "llama-bf16-r0"
    pid = fleet.runtime_pids()[victim]
    streaming = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(4) as pool:
        doomed = [pool.submit(_stream_until_error, fleet.base_url, "llama-bf16", s)
                  for s in streaming]
        # Kill once every stream has its first chunk: after a fixed 3 s sleep a run found all
        # three streams finished (about 300 tokens to EOS) before the kill.
        for s in streaming:
            assert s.wait(120), "a stream never started"
        os.killpg(pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in doomed]
    assert all(r.startswith("error") for r in results), results
    # The other models keep answering while the victim restarts.
    client = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key="unused", timeout=300)
    for model in ("qwen2-bf16", "llama-small-fp16"):
        assert client.completions.create(model=model, prompt="still", max_tokens=2).choices
    deadline = time.monotonic() + START_TIMEOUT_S
    # Until the launcher notices the death, /health still lists the old pid as up.
    while fleet.runtime_pids()[victim] == pid or fleet.health()["status"] != "ok":
        assert time.monotonic() < deadline, "the killed runtime never came back"
        time.sleep(2)
    out = fleet.output.read_text()
    assert f"reclaimed the slabs of ['{victim}']" in out, out[-3000:]
    assert f'fineslab_runtime_restarts{{model="llama-bf16",runtime="{victim}"}} 1.0' \
        in fleet.metrics()
    reply = client.completions.create(model="llama-bf16", prompt="back", max_tokens=2)
    assert reply.choices, "the restarted runtime serves again"


def test_the_demo_notebook_drives_this_fleet(fleet: LaunchedFleet) -> None:
    """examples/cpu-demo.ipynb with FINESLAB_FLEET_URL set, against this module's fleet (the
    notebook's own start would be one more fleet of the same file, a minute and a half here):
    SmolLM2 answers its question in words, the openai client gets a completion and a streamed
    chat from every model, the burst is answered or dropped with 429, /metrics has a TTFT for
    every model, and the notebook leaves the fleet running."""
    outputs = execute_notebook("cpu-demo.ipynb", {
        "FINESLAB_MODEL_CACHE": str(fleet.model_cache), "FINESLAB_FLEET_URL": fleet.base_url})
    assert outputs.count("chat(stream)=") == len(MODELS), outputs[:3000]
    assert "smollm2 says:" in outputs and "Paris" in outputs, outputs[:3000]
    outcomes = ast.literal_eval(outputs.split("samples of /metrics; ")[1].splitlines()[0])
    assert sum(outcomes.values()) == 18 and set(outcomes) <= {"served", "dropped"}, outcomes
    ttft = ast.literal_eval(outputs.split("TTFT measured for ")[1].split(" owners")[0])
    assert sorted(ttft) == sorted(MODELS) and all(ttft.values()), outputs[-2000:]
    assert f"the fleet at {fleet.base_url} keeps running" in outputs, outputs[-2000:]
    assert fleet.get("/health").status_code == 200
    removed = re.search(r"removed (\S*fineslab-notebook-\S+)", outputs)
    assert removed and not Path(removed.group(1)).exists(), "its folder is gone (#39 finding 6)"


def test_shutdown_leaves_no_process_and_no_shared_memory(fleet: LaunchedFleet) -> None:
    pids = list(fleet.runtime_pids().values())
    record = json.loads(Path(f"/dev/shm/fineslab-{fleet.fleet_id}.run").read_text())
    sglang_files = [f for r in record["runtimes"].values() for f in r["shm_files"]]
    assert any("sglang_loads_" in f for f in sglang_files), record  # what SGLang leaks
    os.killpg(fleet.proc.pid, signal.SIGTERM)
    assert fleet.proc.wait(180) == 0, fleet.output.read_text()[-3000:]
    time.sleep(0.5)
    alive = [pid for pid in [*pids, fleet.proc.pid] if group_alive(pid)]
    assert not alive, f"process groups still alive: {alive}"
    leftovers = shm_files(fleet.fleet_id)
    assert not leftovers, leftovers
    # issue #15, defect 6: every runtime start left SGLang's sglang_loads_*.shm and sem.mp-*
    assert not [f for f in sglang_files if Path(f).exists()], sglang_files
    assert not Path(f"/dev/shm/fineslab-{fleet.fleet_id}.run").exists()
    out = fleet.output.read_text()
    assert "fleet stopped" in out and "[4/4] runtime" in out and "stopped after" in out

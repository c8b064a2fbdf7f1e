"""The router in front of one real SGLang runtime (llama-tiny on CPU, SGLang's own KV pool):
the `openai` client, streaming and not, completions and chat; a real-tokenizer length check;
`python -m fineslab.bench.bench_serving` as the docs give it.
One runtime for the module: about 40 s on an idle 2-core machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fineslab.scheduler.local import TtftPredictor

from fineslab import cpu_mode
from fineslab.bench.sharegpt_mini import DATASET_FILE
from fineslab.env import CPU_MODE_VAR, SGLANG_CPU_ENGINE_VAR
from fineslab.router import ModelRoute, ReplicaRoute, Router, RouterServer, RouterSettings
from fineslab.runtime import ServerSpec, free_port, start_server

pytestmark = pytest.mark.slow


class FlatPredictor:
    def ttft_s(self, prompt_tokens: object) -> float:
        return 0.05


@pytest.fixture(scope="module")
def router(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = model_cache / "llama-tiny"
    spec = ServerSpec(str(model_dir), free_port(), extra_args=(
        "--served-model-name", "tiny", "--max-total-tokens", "4096", "--context-length", "512"))
    log = tmp_path_factory.mktemp("router-sglang") / "runtime.log"
    predictor: TtftPredictor = FlatPredictor()
    with start_server(spec, log, timeout_s=600) as runtime:
        route = ModelRoute("tiny", (ReplicaRoute("tiny-r0", runtime.spec.base_url),), 30.0,
                           predictor, tokenizer_dir=str(model_dir), context_tokens=512)
        server = RouterServer(Router([route], RouterSettings()))
        server.start()
        try:
            yield server.base_url
        finally:
            server.stop()


def test_openai_client_completion_non_streaming(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    reply = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0)
    assert reply.choices[0].text, "the runtime generated text through the router"
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_openai_client_completion_streaming(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    stream = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                       temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) >= 2 and "".join(pieces), pieces


def test_openai_client_chat_streaming_and_not(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something"}]
    reply = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                           max_tokens=6, temperature=0)
    assert reply.choices[0].message.content is not None
    stream = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                            max_tokens=6, temperature=0, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == reply.choices[0].message.content, "greedy: same text both ways"


def test_over_long_prompt_is_refused_by_the_router_with_the_real_tokenizer(router: str) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello world " * 400, max_tokens=4)
    assert "context" in str(info.value)
    assert httpx.get(router + "/health").status_code == 200


def test_streamed_requests_feed_ttft_and_tpot_metrics(router: str) -> None:
    text = httpx.get(router + "/metrics").text
    count = next(line for line in text.splitlines()
                 if line.startswith('fineslab_ttft_seconds_count{model="tiny"}'))
    assert float(count.split()[-1]) >= 2, count
    assert 'fineslab_tpot_seconds_count{model="tiny"}' in text


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


def test_bench_serving_wrapper_runs_the_random_dataset_offline(
        router: str, model_cache: Path, tmp_path: Path) -> None:
    """The README's command: `random` (prompts cut from ShareGPT text) without --dataset-path,
    from a shell without the CPU stubs. Guards issue #15: `No module named 'torchvision'`, then
    a ShareGPT download."""
    hf_home = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "-m", "fineslab.bench.bench_serving", "--backend", "sglang-oai",
         "--base-url", router, "--model", "tiny", "--tokenizer", str(model_cache / "llama-tiny"),
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
         "--random-range-ratio", "1.0", "--num-prompts", "8", "--request-rate", "8",
         "--output-file", str(tmp_path / "results.jsonl"), "--disable-tqdm"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=_environ_without_cpu_mode(hf_home))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert f"dataset_path='{DATASET_FILE}'" in out, "the shipped ShareGPT file was used"
    match = re.search(r"Successful requests:\s+(\d+)", out)
    assert match and int(match.group(1)) == 8, out[-3000:]
    assert not hf_home.exists() or not any(hf_home.rglob("*.json")), "nothing was downloaded"
    assert (tmp_path / "results.jsonl").stat().st_size > 0, "the client wrote its results"

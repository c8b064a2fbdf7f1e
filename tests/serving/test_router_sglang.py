"""The router in front of one real SGLang runtime (llama-tiny on CPU, SGLang's own KV pool):
the `openai` client, streaming and not, completions and chat; a real-tokenizer length check.
One runtime for the module: about 40 s on an idle 2-core machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fineslab.scheduler.local import TtftPredictor

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

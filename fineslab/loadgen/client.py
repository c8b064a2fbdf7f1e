"""One streamed request against an OpenAI-compatible `/v1/completions` endpoint.

    POST {base_url}/v1/completions  {"model", "prompt", "max_tokens", "stream": true,
         "temperature": 0, "ignore_eos": true, "stream_options": {"include_usage": true}}

Each server-sent event `data: {...}` carrying text is one arrival of tokens: the first one's
time minus the send time is the TTFT, the gaps between the following ones are the ITLs. The
output length is the server's `usage.completion_tokens` when it reports it, else the number of
chunks with text. `ignore_eos` is an SGLang/vLLM extension (generation runs to `max_tokens`);
servers that reject unknown fields can be driven with `ignore_eos=False`.

A request that fails (HTTP error, broken stream, timeout) is returned as an outcome with
`dropped` set to the reason: the load generator never raises for one bad request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass

import aiohttp

from fineslab.loadgen.metrics import RequestOutcome
from fineslab.workload import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    ignore_eos: bool = True
    timeout_s: float = 600.0
    api_key: str | None = None


@dataclass
class _Stream:
    send_s: float
    chunk_times_s: list[float]
    completion_tokens: int | None = None
    prompt_tokens: int | None = None


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, request: Request,
                       model_name: str, prompt: str, arrival_s: float,
                       ttft_slo_s: float | None) -> RequestOutcome:
    """Stream one completion; the outcome's times are relative to its own send time."""
    body: dict[str, object] = {
        "model": model_name, "prompt": prompt, "max_tokens": request.output_tokens,
        "stream": True, "temperature": 0.0, "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    stream = _Stream(time.perf_counter(), [])
    try:
        async with session.post(f"{cfg.base_url.rstrip('/')}/v1/completions", json=body,
                                headers=headers,
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return _failed(request, arrival_s, ttft_slo_s, f"HTTP {resp.status}: {text}")
            await _read_events(resp, stream)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return _failed(request, arrival_s, ttft_slo_s, f"{type(exc).__name__}: {exc}")
    if not stream.chunk_times_s:
        return _failed(request, arrival_s, ttft_slo_s, "stream ended without a token")
    times = stream.chunk_times_s
    return RequestOutcome(
        request.request_id, request.model, arrival_s,
        stream.prompt_tokens or request.prompt_tokens,
        stream.completion_tokens or len(times), times[0] - stream.send_s,
        times[-1] - stream.send_s, ttft_slo_s=ttft_slo_s,
        itl_s=tuple(b - a for a, b in itertools.pairwise(times)))


async def _read_events(resp: aiohttp.ClientResponse, stream: _Stream) -> None:
    async for raw in resp.content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        choices = event.get("choices") or []
        if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
            stream.chunk_times_s.append(time.perf_counter())
        usage = event.get("usage")
        if usage:
            stream.completion_tokens = usage.get("completion_tokens")
            stream.prompt_tokens = usage.get("prompt_tokens")


def _failed(request: Request, arrival_s: float, ttft_slo_s: float | None,
            reason: str) -> RequestOutcome:
    logger.warning("request %s failed: %s", request.request_id, reason)
    return RequestOutcome(request.request_id, request.model, arrival_s, request.prompt_tokens,
                          0, None, None, dropped=reason, ttft_slo_s=ttft_slo_s)

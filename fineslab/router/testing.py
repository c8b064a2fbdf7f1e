"""A fast OpenAI-compatible backend for router tests and the router benchmark (not SGLang).

A real SGLang tiny model on 2 CPU cores serves a few requests a second; measuring what the
router *adds* at 200 requests/s needs a backend that answers in microseconds. This one answers
`/v1/completions` and `/v1/chat/completions` with `max_tokens` tokens ("tok0 tok1 ..."),
optionally after `delay_s` (the same for every request, so it cancels out of router-vs-direct
comparisons), streaming by SSE when asked, and `/health`. A body with `echo_status` (an int)
gets that status with SGLang's error body and `echo_message` as its message, so tests can see
what the router makes of a runtime's errors; a body with `echo_crash: true` makes the backend
exit at once (a request that kills its runtime).

    python -m fineslab.router.testing --port 9001 [--delay-ms 5] [--token-gap-ms 0]
    proc = start_echo_backend(port, delay_s=0.0)   # a subprocess; proc.terminate() to stop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fineslab.runtime import wait_until_up


class FixedTtftPredictor:
    """A TTFT predictor that answers `ttft_s` for any batch (the echo backend's is ~0)."""

    def __init__(self, ttft_s: float = 0.001) -> None:
        self._ttft_s = ttft_s

    def ttft_s(self, prompt_tokens: object) -> float:
        return self._ttft_s


def _completion(body: dict[str, Any], chat: bool, text: str, index: int) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": f"echo-{index}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": body.get("model", "echo"), "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": index,
                      "total_tokens": index + 1}}


def _chunk(body: dict[str, Any], chat: bool, text: str) -> bytes:
    delta: dict[str, Any] = ({"delta": {"content": text}} if chat else {"text": text})
    event = {"id": "echo", "object": "chat.completion.chunk" if chat else "text_completion",
             "created": int(time.time()), "model": body.get("model", "echo"),
             "choices": [{"index": 0, "finish_reason": None, **delta}]}
    return f"data: {json.dumps(event)}\n\n".encode()


def build_app(delay_s: float = 0.0, token_gap_s: float = 0.0) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def complete(request: Request, chat: bool) -> Response:
        body = json.loads(await request.body())
        if body.get("echo_crash") is True:
            os._exit(1)
        if isinstance(body.get("echo_status"), int):
            return JSONResponse({"object": "error", "message": body.get("echo_message", ""),
                                 "type": "BadRequestError", "param": None,
                                 "code": body["echo_status"]}, body["echo_status"])
        num_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        if delay_s:
            await asyncio.sleep(delay_s)
        if not body.get("stream"):
            text = " ".join(f"tok{i}" for i in range(num_tokens))
            return JSONResponse(_completion(body, chat, text, num_tokens))

        async def events() -> AsyncIterator[bytes]:
            for i in range(num_tokens):
                if token_gap_s and i:
                    await asyncio.sleep(token_gap_s)
                yield _chunk(body, chat, f" tok{i}")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def health(request: Request) -> Response:
        return Response("ok")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "echo", "max_model_len": 2048}]})

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health),
        Route("/v1/models", models),
    ])


def start_echo_backend(port: int, delay_s: float = 0.0, token_gap_s: float = 0.0,
                       timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """Start the backend in a subprocess and wait until `/health` answers."""
    proc = subprocess.Popen([sys.executable, "-m", "fineslab.router.testing", "--port", str(port),
                             "--delay-ms", str(delay_s * 1000),
                             "--token-gap-ms", str(token_gap_s * 1000)])
    wait_until_up(proc, f"http://127.0.0.1:{port}/health", "echo backend", timeout_s)
    return proc


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m fineslab.router.testing")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--token-gap-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.delay_ms / 1000, args.token_gap_ms / 1000), host="127.0.0.1",
                port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

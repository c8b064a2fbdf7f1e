"""Crash attribution: which request took a runtime down, so it alone gets the error.

Validation stops every request the router knows a runtime chokes on; this is for the ones it
does not know yet. When a runtime goes down under requests that had no answer yet
(`RuntimeLost`), each of them becomes a suspect (its body's fingerprint is noted) and is sent
once more through its model's quarantine, one suspect at a time while fresh traffic flows as
usual: at once when a replica can take it within its TTFT SLO (another replica, a quick
restart), else when its client sends it again (it got the runtime's 502 meanwhile). A suspect
that is in flight in quarantine when a runtime goes down was at two crashes, the second time
as the only request with a crash behind it: it is refused (400 `request_crashed_runtime`) and
remembered as poison, so that sending it again is refused at once instead of taking the
runtime down once more. A suspect served in quarantine is cleared.

    suspects, poison <= MAX_FINGERPRINTS each (oldest forgotten first), kept TTL_S
    suspects of a model in flight at once <= 1

A runtime killed from outside while a suspect is in quarantine makes that suspect poison too:
the rule cannot tell the two apart, and errs towards protecting the runtime.

Cost: a blake2b digest of every body (about 1 GB/s: microseconds for a chat request; bodies
over 16 KiB are hashed on the parse pool), and nothing else until a runtime goes down.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from starlette.responses import JSONResponse, Response

from fineslab.router.proxy import RuntimeLost, error_body

logger = logging.getLogger(__name__)

#: One try: the response, and whether a runtime answered it (not the queue refusing it).
Attempt = Callable[[], Awaitable[tuple[Response, bool]]]

MAX_FINGERPRINTS = 4096
TTL_S = 3600.0


def fingerprint(path: str, raw: bytes) -> str:
    return hashlib.blake2b(path.encode() + b"\0" + raw, digest_size=16).hexdigest()


class _Fingerprints:
    """A bounded, expiring set of body fingerprints."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._clock = clock

    def __contains__(self, key: str) -> bool:
        seen_s = self._seen.get(key)
        if seen_s is not None and self._clock() - seen_s > TTL_S:
            del self._seen[key]
            return False
        return seen_s is not None

    def add(self, key: str) -> None:
        self._seen[key] = self._clock()
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_FINGERPRINTS:
            self._seen.popitem(last=False)

    def discard(self, key: str) -> None:
        self._seen.pop(key, None)


class CrashAttribution:
    """Suspects, quarantine and poison, per router (touched on its loop only)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.suspects = _Fingerprints(clock)
        self.poison = _Fingerprints(clock)
        self._quarantine: dict[str, asyncio.Lock] = {}

    def is_poison(self, key: str) -> bool:
        return key in self.poison

    def refuse(self, model: str) -> JSONResponse:
        return JSONResponse(error_body(
            f"this request took a runtime of model {model} down, twice; it is refused "
            "(change it, or report it: the runtime should not crash)", "invalid_request_error",
            "request_crashed_runtime"), 400)

    async def serve(self, model: str, key: str, attempt: Attempt,
                    can_retry: Callable[[], bool]) -> Response:
        """`attempt()` (queue, then forward) with the rules of the module docstring."""
        if key not in self.suspects:
            try:
                reply, _ = await attempt()
                return reply
            except RuntimeLost as lost:
                logger.warning("model %s: a runtime went down under request %s (a suspect now)",
                               model, key[:12])
                self.suspects.add(key)
                if not can_retry():
                    return lost.response
        async with self._quarantine.setdefault(model, asyncio.Lock()):
            try:
                reply, reached_runtime = await attempt()
            except RuntimeLost:
                self.suspects.discard(key)
                self.poison.add(key)
                logger.error("model %s: request %s was in flight at a second runtime crash, "
                             "alone in quarantine; refusing it from now on", model, key[:12])
                return self.refuse(model)
        if reached_runtime:  # a runtime answered it: cleared (a queue's 503 proves nothing)
            self.suspects.discard(key)
        return reply

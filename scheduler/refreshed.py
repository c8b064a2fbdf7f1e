"""The TTFT predictor refreshed from timed prefill steps, and shared with the router.

The profile a runtime's engine schedule carries was measured once, elsewhere (in-process or
through HTTP, on an idle machine or not), so it is wrong in two ways a runtime can see:

    its level       the machine's speed changes under other load, and a profile measured
                    through HTTP charges a request's fixed cost (HTTP, tokenizer) to every step
    its shape       that fixed cost weighs most on small steps

`RefreshedPredictor` keeps the profile's curve and scales it by what the runtime's own prefill
steps take now (timed by `fineslab.sglang_plugin.step_refresh.StepClock`). Per power-of-two
bucket of n new tokens (and over all steps), the scale is an exponentially weighted mean of
log(measured / profiled), so one outlier step (a page fault, a GC pause) moves it by a bounded
factor; a bucket with fewer than `MIN_SAMPLES` steps uses the all-steps scale. A step whose
sample ratio falls outside [1/MAX_RATIO, MAX_RATIO] is clamped, and the scale itself stays
within the same bounds.

One predictor for the router's gate and the engine: a runtime writes its scales to a small
JSON file (`write_scales`, at most every PUBLISH_S, renamed into place), and the router's gate
for the model decides with `FollowedPredictor`, the same profile scaled by its runtimes' files
(a sample-weighted mean of their log scales per bucket; a missing, unreadable or malformed
file counts as no samples, so the gate falls back to the profile as given).

A scale ages: one no step has refreshed for HALF_LIFE_S counts half (its log is halved), so
after a few minutes without a step the profile is back as given. Without it a gate that the
steps of a loaded minute taught to drop every request "even alone" would never again let
through the request whose step would show the machine is idle again. Each mean carries the
wall-clock time it is as of; the runtime ages its own, the router a file's from that time.

    {"overall": [log_scale, samples, as_of_s],
     "buckets": {"<bucket>": [log_scale, samples, as_of_s], ...}}
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fineslab.scheduler.predictors import ChunkedPrefillPredictor, chunked_prefill_s

from fineslab.jsonfile import write_json_whole

logger = logging.getLogger(__name__)

#: Weight of the newest step in the exponentially weighted mean of log ratios.
ALPHA = 0.2
#: A bucket's own scale is used once it has seen this many steps.
MIN_SAMPLES = 3
#: Bound on one step's measured / profiled ratio and on the scale.
MAX_RATIO = 64.0
#: The scale is logged when it has moved by this factor since it was last logged.
LOG_FACTOR = 1.25
#: A runtime writes its scales at most this often (seconds); the router rereads them as often.
PUBLISH_S = 0.5
#: A scale no step has refreshed for this long (seconds) counts half (module doc).
HALF_LIFE_S = 30.0


def bucket_of(tokens: int) -> int:
    """The power-of-two bucket of a step of `tokens` new tokens (1 -> 0, 2-3 -> 1, ...)."""
    return max(0, int(tokens).bit_length() - 1)


@dataclass
class _Mean:
    """An exponentially weighted mean of log ratios, how many steps fed it, and the wall-clock
    time it is as of (None: never aged, as in a file of the two-field shape)."""

    log_scale: float = 0.0
    samples: int = 0
    as_of_s: float | None = None

    def to_pair(self) -> list[float]:
        return [self.log_scale, self.samples] + ([] if self.as_of_s is None else [self.as_of_s])

    @classmethod
    def of_pair(cls, pair: Sequence[float], now_s: float) -> _Mean:
        """A file's mean, aged to `now_s`."""
        mean = cls(float(pair[0]), int(pair[1]), float(pair[2]) if len(pair) > 2 else None)
        mean.age(now_s)
        return mean

    @classmethod
    def merged(cls, means: Iterable[_Mean]) -> _Mean:
        """The sample-weighted mean of several means' log scales (aged to one time), their
        samples summed."""
        means = list(means)
        total = sum(m.samples for m in means)
        if total <= 0:
            return cls()
        bound = math.log(MAX_RATIO)
        mean = sum(m.log_scale * m.samples for m in means) / total
        as_of = [m.as_of_s for m in means if m.as_of_s is not None]
        return cls(min(bound, max(-bound, mean)), total, max(as_of) if as_of else None)

    def age(self, now_s: float) -> None:
        """Halve the log scale for every HALF_LIFE_S since it was as of (module doc)."""
        if self.as_of_s is not None and now_s > self.as_of_s:
            self.log_scale *= 0.5 ** ((now_s - self.as_of_s) / HALF_LIFE_S)
            self.as_of_s = now_s

    def add(self, log_ratio: float, now_s: float) -> None:
        self.age(now_s)
        weight = ALPHA if self.samples else 1.0
        self.log_scale += weight * (log_ratio - self.log_scale)
        self.samples += 1
        self.as_of_s = now_s


@dataclass
class RefreshedPredictor:
    """A `ChunkedPrefillPredictor` whose step times are scaled by measured steps (module
    docstring); same `prefill_tokens_s` / `ttft_s` as the base, so the policies take it."""

    base: ChunkedPrefillPredictor
    overall: _Mean = field(default_factory=_Mean)
    buckets: dict[int, _Mean] = field(default_factory=dict)
    #: Wall clock (s) of the steps and of aging: shared with the router through the file.
    clock: Callable[[], float] = field(default=time.time, repr=False)
    _logged_log_scale: float = 0.0
    #: _bounds[b]: the (least, most) a step of bucket b may take (see `_rebound`).
    _bounds: list[tuple[float, float]] = field(default_factory=list)

    @property
    def chunk_tokens(self) -> int:
        return self.base.chunk_tokens

    def scale(self, tokens: int) -> float:
        """The factor applied to the profiled time of a step of `tokens` new tokens."""
        bucket = bucket_of(tokens)
        return math.exp((self.buckets[bucket] if self._own(bucket) else self.overall).log_scale)

    def _scaled(self, tokens: int) -> float:
        return self.scale(tokens) * self.base.prefill_s(tokens)

    def _own(self, bucket: int) -> bool:
        """Whether `bucket` has seen enough steps to use its own scale."""
        mean = self.buckets.get(bucket)
        return mean is not None and mean.samples >= MIN_SAMPLES

    def step_s(self, tokens: int) -> float:
        """One prefill step of `tokens` new tokens, as this runtime runs it now: the scaled
        profile, kept within its bucket's bounds (`_rebound`), so that the TTFT never shrinks
        as tokens are added (Algorithm 2 relies on it)."""
        if tokens <= 0:
            return 0.0
        bucket = bucket_of(tokens)
        scaled = self._scaled(tokens)
        if bucket >= len(self._bounds):  # more than a chunk: never less than a chunk
            return max(scaled, self.step_s(self.chunk_tokens)) if self._bounds else scaled
        low, high = self._bounds[bucket]
        return min(max(scaled, low), high)

    def _rebound(self) -> None:
        """Recompute `_bounds` after the scales moved: per bucket up to the chunk's, the
        (least, most) a step of it may take. A bucket with MIN_SAMPLES steps of its own takes at
        least the longest step of any such bucket below it (bucket scales differ). A bucket
        without (it has the overall scale) is held between those around it: at least the
        longest step below, at most the shortest step above. So the chunk's own measured steps
        are never overridden by the overall mean of other sizes (short requests' steps, with
        their fixed cost, or a machine that was slower before), and a small step is never
        predicted slower than a measured larger one."""
        top = bucket_of(self.chunk_tokens)
        lows, shortest = [], {}
        longest = 0.0
        for bucket in range(top + 1):
            lows.append(longest)
            if self._own(bucket):
                shortest[bucket] = max(longest, self._scaled(2 ** bucket))
                longest = max(longest, self._scaled(2 ** (bucket + 1) - 1))
        highs, cap = [math.inf] * (top + 1), math.inf
        for bucket in range(top, -1, -1):
            if bucket in shortest:
                cap = min(cap, shortest[bucket])
            else:
                highs[bucket] = cap
        self._bounds = list(zip(lows, highs, strict=True))

    def to_doc(self) -> dict[str, Any]:
        """The scales as the file the router's gate follows (module doc)."""
        return {"overall": self.overall.to_pair(),
                "buckets": {str(b): m.to_pair() for b, m in sorted(self.buckets.items())}}

    @classmethod
    def from_docs(cls, base: ChunkedPrefillPredictor, docs: Sequence[Mapping[str, Any]],
                  now_s: float) -> RefreshedPredictor:
        """`base` scaled by the merged scales of several runtimes' files (`to_doc`), each
        aged to `now_s` (wall clock)."""
        predictor = cls(base)
        predictor.overall = _Mean.merged([_Mean.of_pair(d["overall"], now_s) for d in docs])
        keys = sorted({int(k) for d in docs for k in d["buckets"]})
        predictor.buckets = {k: _Mean.merged([_Mean.of_pair(d["buckets"][str(k)], now_s)
                                              for d in docs if str(k) in d["buckets"]])
                             for k in keys}
        predictor._rebound()
        return predictor

    def age(self) -> None:
        """Age every scale to now (module doc); the runtime calls it between steps."""
        now_s = self.clock()
        for mean in (self.overall, *self.buckets.values()):
            mean.age(now_s)
        self._rebound()

    def prefill_tokens_s(self, total_tokens: int) -> float:
        return chunked_prefill_s(total_tokens, self.chunk_tokens, self.step_s)

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.prefill_tokens_s(sum(prompt_tokens))

    def observe(self, tokens: int, seconds: float) -> None:
        """One measured prefill step; ignored when either side is not a positive time."""
        profiled = self.base.prefill_s(tokens) if tokens > 0 else 0.0
        if not (profiled > 0 and math.isfinite(seconds) and seconds > 0):
            return
        bound = math.log(MAX_RATIO)
        log_ratio = min(bound, max(-bound, math.log(seconds / profiled)))
        now_s = self.clock()
        self.overall.add(log_ratio, now_s)
        self.buckets.setdefault(bucket_of(tokens), _Mean()).add(log_ratio, now_s)
        self._rebound()
        if abs(self.overall.log_scale - self._logged_log_scale) >= math.log(LOG_FACTOR):
            self._logged_log_scale = self.overall.log_scale
            logger.info("fineslab engine scheduler: prefill steps run at %.2fx the profile "
                        "(%d steps timed; last %d tokens in %.1f ms)",
                        math.exp(self.overall.log_scale), self.overall.samples, tokens,
                        seconds * 1e3)


def write_scales(path: Path, predictor: RefreshedPredictor) -> None:
    """Write `predictor`'s scales whole (`fineslab.jsonfile`)."""
    write_json_whole(path, predictor.to_doc())


def read_scales(path: Path) -> dict[str, Any] | None:
    """A runtime's scales file, None when it is missing, unreadable or not of the shape
    `to_doc` writes (the gate then counts no samples from it)."""
    try:
        doc = json.loads(path.read_text())
        buckets = {str(int(k)): v for k, v in doc["buckets"].items()}
        pairs = [doc["overall"], *buckets.values()]
        if not all(len(p) in (2, 3) and all(math.isfinite(float(x)) for x in p)
                   and int(p[1]) >= 0 for p in pairs):
            return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return {"overall": doc["overall"], "buckets": buckets}


@dataclass
class FollowedPredictor:
    """The router's gate of a model: its profile scaled as its runtimes measure their steps,
    read from their scales files (`paths`) at most every PUBLISH_S (module doc)."""

    base: ChunkedPrefillPredictor
    paths: tuple[Path, ...]
    clock: Callable[[], float] = time.monotonic
    #: The wall clock the files' scales are aged by.
    wall: Callable[[], float] = time.time
    _current: RefreshedPredictor | None = field(default=None, repr=False)
    _loaded_s: float = -math.inf

    @property
    def chunk_tokens(self) -> int:
        return self.base.chunk_tokens

    def current(self) -> RefreshedPredictor:
        """The predictor as of the files' last read (reread when PUBLISH_S has passed)."""
        now_s = self.clock()
        if self._current is None or now_s - self._loaded_s >= PUBLISH_S:
            docs = [doc for path in self.paths if (doc := read_scales(path)) is not None]
            self._current = RefreshedPredictor.from_docs(self.base, docs, self.wall())
            self._loaded_s = now_s
        return self._current

    def prefill_tokens_s(self, total_tokens: int) -> float:
        return self.current().prefill_tokens_s(total_tokens)

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.current().ttft_s(prompt_tokens)

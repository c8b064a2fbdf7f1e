"""Latency and throughput predictors read off a profile.

The local scheduler's TTFT predictor models chunked prefill: the prompts of a batch are
concatenated and prefilled in chunks of `chunk_tokens`; the batch's first tokens are all out when
the last chunk finishes, so

    TTFT(R) = floor(T / C) * prefill_s(C) + prefill_s(T mod C),   T = sum of prompt tokens in R

with prefill_s the profiled step latency of that many batched tokens (0 for 0 tokens). It is
monotone in R (adding a request never shortens it), which Algorithm 2's guarantee relies on.
A batch of one request is the same formula, so "TTFT(r)" and "TTFT(S)" are one function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fineslab.scheduler.curves import PiecewiseLinear
from fineslab.scheduler.profile_schema import ModelProfile

from fineslab.errors import ConfigError


def chunked_prefill_s(total_tokens: int, chunk_tokens: int,
                      step_s: Callable[[int], float]) -> float:
    """The module docstring's TTFT: full chunks of `chunk_tokens`, then the rest, each step
    timed by `step_s` (0 for 0 tokens)."""
    full_chunks, rest_tokens = divmod(total_tokens, chunk_tokens)
    return full_chunks * step_s(chunk_tokens) + (step_s(rest_tokens) if rest_tokens > 0 else 0.0)


@dataclass(frozen=True)
class ChunkedPrefillPredictor:
    """TTFT of a batch of prompts under chunked prefill (see the module docstring)."""

    prefill_s: PiecewiseLinear
    chunk_tokens: int

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> ChunkedPrefillPredictor:
        return cls(profile.prefill_s, profile.chunk_tokens)

    def prefill_tokens_s(self, total_tokens: int) -> float:
        return chunked_prefill_s(total_tokens, self.chunk_tokens, self.prefill_s)

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        """Seconds from now until every prompt in the batch has been prefilled."""
        return self.prefill_tokens_s(sum(prompt_tokens))


def decode_tokens_per_s(profile: ModelProfile, batch_size: int) -> float:
    """Generated tokens/s at `batch_size` (the profile's throughput table)."""
    return profile.throughput_tokens_per_s(batch_size)


def request_rate_capacity_per_s(profile: ModelProfile, batch_size: int,
                                output_tokens: int) -> float:
    """Requests/s one replica completes at `batch_size` when each request emits
    `output_tokens` tokens."""
    return decode_tokens_per_s(profile, batch_size) / max(1, output_tokens)


class FlatPredictor:
    """TTFT of any batch = `ttft_s`: for a route without a profile (the standalone router's
    `--ttft-s`, tests)."""

    def __init__(self, ttft_s: float) -> None:
        self.ttft_s_value = ttft_s

    def ttft_s(self, prompt_tokens: Iterable[int]) -> float:
        return self.ttft_s_value

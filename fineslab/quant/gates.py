"""Accuracy gates of a quantized runtime against its reference, from SGLang's prompt logprobs.

A gate compares two runtimes on the same prompts, position by position (teacher forcing: both
read the same prompt, so every position has the same prefix):

    top1_agreement   fraction of positions whose most likely next token is the same
    cosine           centered cosine similarity of the next-token log-prob vectors over the
                     reference's top-k tokens (centering removes the per-position log-sum-exp,
                     so this equals the centered cosine of the logits on those tokens)
    kl_mean          mean KL(reference || runtime) in nats over the reference's top-k tokens
                     (both renormalized there; a token missing from the runtime's top-k gets
                     its smallest logprob): a truncated estimate of the full KL
    ppl_ratio        perplexity of a fixed text under the runtime / under the reference

Input: SGLang `/generate` results with `return_logprob`, `logprob_start_len=0` and
`top_logprobs_num=k` (`meta_info.input_top_logprobs`, `input_token_logprobs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: The gates' fixed prompts (teacher-forced, every position) and perplexity text: the precision
#: tests and `fineslab.bench.precisions` measure on these.
GATE_PROMPTS = (
    "The slab arena holds the key and value cache of every model",
    "Once upon a time, in a data center far away, four models shared one GPU",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Quantization trades a little accuracy for a lot of memory: four bits instead of sixteen",
)
GATE_TEXT = (
    "Large language models are served from GPUs whose memory holds the weights and the key "
    "value cache. When many models share a device, the cache of each one grows and shrinks with "
    "its load, and a shared pool of fixed-size slabs lets memory follow the load without copying."
)
#: Top log-probs per position the gates compare.
GATE_TOP_K = 64


@dataclass(frozen=True)
class GateResult:
    top1_agreement: float
    cosine_mean: float
    cosine_min: float
    num_positions: int
    kl_mean: float


def _top_maps(result: dict[str, Any]) -> list[dict[int, float]]:
    """Per prompt position (after the first), token id -> logprob of the top-k entries."""
    rows = result["meta_info"]["input_top_logprobs"]
    return [{int(tok): float(lp) for lp, tok, *_ in row} for row in rows if row]


def compare_top_logprobs(reference: Sequence[dict[str, Any]],
                         candidate: Sequence[dict[str, Any]]) -> GateResult:
    """Top-1 agreement and cosine over every position of every prompt."""
    agree, cosines, kls = 0, [], []
    for ref_result, cand_result in zip(reference, candidate, strict=True):
        for ref, cand in zip(_top_maps(ref_result), _top_maps(cand_result), strict=True):
            agree += max(ref, key=ref.__getitem__) == max(cand, key=cand.__getitem__)
            tokens = sorted(ref)
            floor = min(cand.values())
            a = torch.tensor([ref[t] for t in tokens], dtype=torch.float64)
            b = torch.tensor([cand.get(t, floor) for t in tokens], dtype=torch.float64)
            a, b = a - a.mean(), b - b.mean()
            log_p, log_q = a.log_softmax(0), b.log_softmax(0)
            kls.append(float((log_p.exp() * (log_p - log_q)).sum()))
            cosines.append(float(a @ b / (a.norm() * b.norm()).clamp(min=1e-12)))
    n = len(cosines)
    return GateResult(agree / n, sum(cosines) / n, min(cosines), n, sum(kls) / n)


def perplexity(result: dict[str, Any]) -> float:
    """exp(mean negative log-likelihood) of the prompt tokens after the first."""
    lps = [float(lp) for lp, *_ in result["meta_info"]["input_token_logprobs"] if lp is not None]
    return math.exp(-sum(lps) / len(lps))

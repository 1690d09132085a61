"""Next tokens from logits, each request with its own temperature, top-k, top-p and random stream."""

from __future__ import annotations

import torch
from torch import Tensor

from serving.request import Request, TokenLogprob


def sample(logits: Tensor, requests: list[Request], fallback: torch.Generator) -> list[tuple[int, TokenLogprob | None]]:
    """One token per row of `logits` `[rows, vocab]` (float32, CPU).

    Log-probabilities are those of the model's own distribution (before temperature and
    cuts), as vLLM reports them by default.
    """
    log_probs = torch.log_softmax(logits, dim=-1)
    results = []
    for row, request in zip(logits, requests, strict=True):
        params = request.params
        if params.greedy:
            token = int(row.argmax())
        else:
            token = _draw(row, params.temperature, params.top_k, params.top_p, request.generator or fallback)
        logprob = None
        if params.logprobs is not None:
            own = log_probs[len(results)]
            top = own.topk(params.logprobs) if params.logprobs else None
            alternatives = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else ()
            logprob = TokenLogprob(token, float(own[token]), alternatives)
        results.append((token, logprob))
    return results


def _draw(row: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    scaled = row / temperature
    if 0 < top_k < scaled.shape[0]:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if top_p < 1:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p, 0.0)  # the most likely one always stays
        probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))

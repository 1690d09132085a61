"""Next tokens from logits, one batched step for every request of an iteration.

In vLLM's order: the grammar's token mask, `allowed_token_ids`, `min_tokens` (no EOS or stop
token yet), `logit_bias`, the repetition, frequency and presence penalties; then argmax for
greedy requests, and for the others temperature, min-p, top-k and top-p, and a draw from
each request's own random stream. Each control is one tensor operation over the rows that
use it: the only Python loops run over requests (a random number each) or over the token
ids a request names, never over the vocabulary.

A row whose controls leave no token possible (a grammar that needs EOS while `min_tokens`
bans it, allowed ids the grammar refuses) gets no token: its request alone ends with an
error, and the rest of the batch is sampled as if it were not there.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from torch import Tensor

from serving.invalid_field import InvalidField
from serving.request import Request, TokenLogprob
from serving.sampling_params import SamplingParams
from serving.structured_output import allowed_next, mask_disallowed


@torch.inference_mode()
def sample(
    logits: Tensor, requests: list[Request], eos_token_ids: Collection[int], fallback: torch.Generator
) -> list[tuple[int, TokenLogprob | None] | SamplingError]:
    """One token per row of `logits` `[rows, vocab]` (float32, CPU), which it may change, or
    the error that ends row i's request alone (no token satisfies its controls).

    Log-probabilities are those of the model's own distribution (before any control), as
    vLLM reports them by default.
    """
    wants_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[wants_logprobs], dim=-1) if wants_logprobs else None
    errors: dict[int, SamplingError] = _constrain(logits, requests, eos_token_ids)
    _penalize(logits, requests)
    # Each row's first maximal index is its greedy token (numpy's argmax is vectorized, where
    # torch's max(dim) compares one by one), and the value there says whether any token is
    # possible: -inf when none is, NaN (argmax's pick wherever there is one) when the row's
    # logits are not finite. One pass over the logits, which at 48 rows are 9 MB.
    rows = logits.numpy()
    greedy_ids = rows.argmax(axis=1)
    possible = (rows[np.arange(len(rows)), greedy_ids] > float("-inf")).tolist()
    greedy = greedy_ids.tolist()
    for i, request in enumerate(requests):
        if not possible[i] and i not in errors:
            errors[i] = SamplingError(f"no token satisfies every constraint of the request ({_controls(request)})")
    if errors:
        logits[list(errors)] = 0.0  # a finite row, so that the batched operations below stay defined
    tokens = _choose(logits, greedy, requests, fallback)
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    if raw is not None:
        top_n = max(requests[i].params.logprobs or 0 for i in wants_logprobs)
        top = raw.topk(top_n) if top_n else None
        for k, i in enumerate(wants_logprobs):
            n = requests[i].params.logprobs or 0
            ids = top.indices[k, :n].tolist() if top is not None else []
            values = top.values[k, :n].tolist() if top is not None else []
            logprobs[i] = TokenLogprob(tokens[i], float(raw[k, tokens[i]]), tuple(zip(ids, values, strict=True)))
    return [errors.get(i) or (tokens[i], logprobs[i]) for i in range(len(requests))]


def check_satisfiable(params: SamplingParams, matcher: Any, eos_token_ids: Collection[int], vocab_size: int) -> None:
    """ValueError naming the field when the request's controls leave no first token possible
    (contradictions that show before it runs; later ones end the request with an error)."""
    if params.allowed_token_ids is None and matcher is None:
        return  # min_tokens alone bans a few ids of the vocabulary
    possible = torch.ones(vocab_size, dtype=torch.bool)
    if params.min_tokens:
        possible[[t for t in {*eos_token_ids, *params.stop_token_ids} if t < vocab_size]] = False
    if params.allowed_token_ids is not None:
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        allowed[list(params.allowed_token_ids)] = True
        if not (possible & allowed).any():
            raise InvalidField(
                "allowed_token_ids",
                f"allowed_token_ids holds only EOS or stop tokens, which min_tokens={params.min_tokens} "
                "forbids before then: no token can be generated",
            )
        possible &= allowed
    if matcher is not None and not (possible & allowed_next(matcher, vocab_size)).any():
        field = "allowed_token_ids" if params.allowed_token_ids is not None else "min_tokens"
        raise InvalidField(field, f"{field} leaves no token that the structured output allows to begin with")


class SamplingError(Exception):
    """Why a request cannot go on: the fault is its own, and no other request's."""


def _controls(request: Request) -> str:
    """The request's controls that can rule tokens out, for the error message."""
    params = request.params
    controls = {
        "structured output": request.matcher is not None,
        "allowed_token_ids": params.allowed_token_ids is not None,
        f"min_tokens={params.min_tokens} (no EOS or stop token yet)": len(request.output_ids) < params.min_tokens,
        "logit_bias": bool(params.logit_bias),
    }
    return ", ".join(name for name, used in controls.items() if used) or "none: the model's logits are not finite"


def _constrain(logits: Tensor, requests: list[Request], eos_token_ids: Collection[int]) -> dict[int, SamplingError]:
    """Grammar masks, allowed tokens, min_tokens bans and logit biases, in place; returns the
    rows whose grammar matcher failed (limits, or an error state), by row."""
    errors: dict[int, SamplingError] = {}
    constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
    if constrained:
        failures = mask_disallowed(logits, constrained, [requests[i].matcher for i in constrained])
        errors.update(
            {constrained[k]: SamplingError(f"structured output: {message}") for k, message in failures.items()}
        )
    whitelisted = [i for i, r in enumerate(requests) if r.params.allowed_token_ids is not None]
    if whitelisted:
        allowed = torch.zeros(len(whitelisted), logits.shape[1], dtype=torch.bool)
        for k, i in enumerate(whitelisted):
            allowed[k, list(requests[i].params.allowed_token_ids)] = True  # type: ignore[arg-type]
        logits[whitelisted] = logits[whitelisted].masked_fill(~allowed, float("-inf"))
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, request in enumerate(requests):
        params = request.params
        if len(request.output_ids) < params.min_tokens:
            banned = {*eos_token_ids, *params.stop_token_ids}
            rows += [i] * len(banned)
            cols += banned
            values += [float("-inf")] * len(banned)
        for token, bias in (params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(float(bias))
    if rows:
        where = (torch.tensor(rows), torch.tensor(cols))
        logits.index_put_(where, torch.tensor(values, dtype=logits.dtype), accumulate=True)
    return errors


def _penalize(logits: Tensor, requests: list[Request]) -> None:
    """Repetition (prompt and output), then frequency and presence (output) penalties, in place."""
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return
    vocab = logits.shape[1]
    chosen = [requests[i] for i in rows]
    output_counts = _counts([r.output_ids for r in chosen], vocab)
    params = [r.params for r in chosen]
    penalized = logits[rows]
    repetition = torch.tensor([p.repetition_penalty for p in params])[:, None]
    seen = (output_counts > 0) | (_counts([r.prompt_ids for r in chosen], vocab) > 0)
    scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
    penalized = torch.where(seen, scaled, penalized)
    penalized -= torch.tensor([p.frequency_penalty for p in params])[:, None] * output_counts
    penalized -= torch.tensor([p.presence_penalty for p in params])[:, None] * (output_counts > 0)
    logits[rows] = penalized


def _counts(sequences: list[list[int]], vocab: int) -> Tensor:
    """`[len(sequences), vocab]` occurrence counts of each token id in each sequence."""
    width = max(map(len, sequences), default=0)
    ids = torch.full((len(sequences), width), vocab, dtype=torch.long)  # padding counts in a spare column
    for k, sequence in enumerate(sequences):
        ids[k, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    counts = torch.zeros(len(sequences), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _choose(logits: Tensor, tokens: list[int], requests: list[Request], fallback: torch.Generator) -> list[int]:
    """`tokens` (each row's argmax) with the rows that do not decode greedily drawn instead."""
    drawn = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not drawn:
        return tokens
    params = [requests[i].params for i in drawn]
    probs = (logits[drawn] / torch.tensor([p.temperature for p in params])[:, None]).softmax(dim=-1)
    if any(p.min_p for p in params):
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor([p.min_p for p in params])[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    order = None
    if any(p.top_k or p.top_p < 1 for p in params):
        probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[1]
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])[:, None]
        probs = probs.masked_fill(torch.arange(vocab)[None] >= k, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely one always stays
    cdf = probs.cumsum(dim=-1)
    # one number from each request's own stream, in (0, 1]: a token of probability 0 is never hit
    uniform = torch.tensor([1 - float(torch.rand(1, generator=requests[i].generator or fallback)) for i in drawn])
    picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[1] - 1)
    if order is not None:
        picks = order.gather(1, picks)
    for i, token in zip(drawn, picks[:, 0].tolist(), strict=True):
        tokens[i] = token
    return tokens

"""The sampler's choice of token per row."""

from __future__ import annotations

import torch

from serving import SamplingParams
from serving.request import Request
from serving.sampler import sample


def test_the_sampler_takes_the_first_maximum_and_fails_only_rows_with_no_finite_choice() -> None:
    def request(name: str, params: SamplingParams) -> Request:
        return Request(name, None, [1], params, None, None)  # type: ignore[arg-type]

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [0.0, 3.0, 3.0, 1.0],  # a tie: the first maximum, as argmax takes it
            [-inf, -inf, -inf, -inf],  # nothing possible
            [0.0, nan, 5.0, 1.0],  # a NaN anywhere: the row's logits are not finite
            [-inf, 2.0, -inf, -inf],
            [9.0, -inf, -inf, -inf],  # drawn at temperature 1: only one token is possible
        ]
    )
    greedy = SamplingParams(max_tokens=1, temperature=0)
    requests = [request(f"r{i}", greedy) for i in range(4)] + [request("drawn", SamplingParams(max_tokens=1, seed=3))]
    choices = sample(logits, requests, frozenset(), torch.Generator().manual_seed(0))
    assert [c[0] if isinstance(c, tuple) else None for c in choices] == [1, None, None, 1, 0]
    assert all("not finite" in str(choices[i]) for i in (1, 2))

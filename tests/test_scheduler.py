"""The scheduler's planning: which prompts fork which."""

from __future__ import annotations

from serving import SamplingParams
from serving.request import Request
from serving.scheduler import assign_fork_parents

GREEDY = SamplingParams(max_tokens=32, temperature=0)


def test_fork_planning_picks_the_longest_shared_prefix() -> None:
    """`assign_fork_parents`: the earlier prompt sharing the most; equal prompts always; short matches never."""

    def request(ids: list[int]) -> Request:
        return Request("r", None, ids, GREEDY, None, None)  # type: ignore[arg-type]

    ids = ([1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 7, 9], [1, 2, 3], [7, 7], [7, 7])
    a, b, c, d, e, f, g = (request(prompt) for prompt in ids)
    assign_fork_parents([a, b, c, d, e, f, g], min_tokens=2)
    assert (b.fork_of, b.fork_at) == (a, 3)
    assert (c.fork_of, c.fork_at) == (a, 4)  # a shares 4 tokens, b only 3
    assert (d.fork_of, d.fork_at) == (c, 5)
    assert (e.fork_of, e.fork_at) == (a, 2)  # not b, which forks a past that point: a computes it
    assert a.fork_of is None and f.fork_of is None  # f shares nothing earlier
    assert (g.fork_of, g.fork_at) == (f, 1)  # equal prompts fork below min_tokens, at their last token

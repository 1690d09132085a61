"""Offline beam search on the engine's KV store, beams forked and pruned by remapping pages.

The search is HF `generate(num_beams=k)`'s (early_stopping=False): each step ranks every
(running beam, next token) by cumulative log-probability and keeps the best 2k (more with
several EOS tokens). Those among the first k that end (EOS, or max_tokens reached) become
finished hypotheses, scored cumulative log-probability / generated tokens ** length_penalty,
and the best k that do not end run on. A prompt's search stops when every candidate ends or
the best running beam, scored at its current length, cannot beat the k-th hypothesis.

Memory: a beam that several continuations extend keeps its slot for the first and is forked
for the others (its whole pages mapped behind their slots, only the last partial page
copied); a beam that none extends frees its slot. Prompts start while their worst case (k
slots of prompt + max_tokens tokens, nothing shared) fits beside the running ones', so the
pool never runs out mid-search.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from serving.config import EngineConfig
from serving.executor import ModelExecutor
from serving.outputs import BeamSearchOutput, BeamSequence
from serving.request import generation_room
from serving.sampling_params import BeamSearchParams


@dataclass(eq=False)
class Beam:
    """A running beam; its slot holds the KV of `all_ids[:num_computed]`."""

    prompt_ids: list[int]
    output_ids: list[int]
    cum_logprob: float
    slot: int
    num_computed: int
    next_logprobs: torch.Tensor | None = None
    """Log-probabilities of the token after `all_ids`, once computed."""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Candidate(NamedTuple):
    """A running beam followed by one more token."""

    parent: Beam
    token: int
    cum_logprob: float

    @property
    def output_ids(self) -> list[int]:
        return [*self.parent.output_ids, self.token]

    @property
    def all_ids(self) -> list[int]:
        return [*self.parent.all_ids, self.token]

    def child(self, slot: int, num_computed: int) -> Beam:
        """The beam this candidate becomes, its KV (all but the new token) in `slot`."""
        return Beam(self.parent.prompt_ids, self.output_ids, self.cum_logprob, slot, num_computed)


@dataclass(eq=False)
class Search:
    """One prompt's beam search."""

    prompt: str | None
    prompt_ids: list[int]
    running: list[Beam] = field(default_factory=list)
    finished: list[BeamSequence] = field(default_factory=list)
    done: bool = False


class Driven(Protocol):
    """What beam search borrows from an idle engine: its executor, and how it reads prompts."""

    config: EngineConfig
    executor: ModelExecutor
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_context: int

    def has_unfinished(self) -> bool: ...

    def encode(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]: ...


class BeamSearch:
    """Runs the beam searches of several prompts in one continuous batch on an idle engine's
    executor: a second driver of the same compute path, with its own schedule."""

    def __init__(self, engine: Driven, params: BeamSearchParams) -> None:
        if engine.has_unfinished():
            raise ValueError("beam search needs the engine to itself: finish or abort its requests first")
        self.engine, self.params = engine, params
        self.executor = engine.executor
        self.kv = engine.executor.kv
        self._ends = frozenset() if params.ignore_eos else engine.eos_token_ids
        self._candidates = max(2, 1 + len(engine.eos_token_ids)) * params.beam_width
        config = engine.config
        if params.beam_width > config.max_slots:
            raise ValueError(f"beam_width {params.beam_width} needs as many KV slots; max_slots is {config.max_slots}")

    def run(
        self, prompts: Sequence[str | Sequence[int]], on_done: Callable[[], None] = lambda: None
    ) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best beams, in prompt order; `on_done` is called as each search ends."""
        searches = [Search(*self.engine.encode(prompt)) for prompt in prompts]
        width, tokens = self.params.beam_width, self.params.max_tokens
        for search in searches:
            if tokens > generation_room(len(search.prompt_ids), self.engine.max_context):
                raise ValueError(
                    f"a prompt of {len(search.prompt_ids)} tokens leaves room for fewer than max_tokens "
                    f"({tokens}) in the max context ({self.engine.max_context} tokens)"
                )
            if self._worst_case(search) > self.engine.config.kv_budget:
                raise ValueError(
                    f"beam search of width {width} over {len(search.prompt_ids)} + {tokens} tokens may need "
                    f"{self._worst_case(search)} B of KV, more than kv_budget ({self.engine.config.kv_budget} B)"
                )
        waiting: deque[Search] = deque(searches)
        active: list[Search] = []
        try:
            while waiting or active:
                while waiting and self._fits(waiting[0], active):
                    active.append(self._start(waiting.popleft()))
                self._iterate([beam for search in active for beam in search.running])
                for search in active:
                    if all(beam.next_logprobs is not None for beam in search.running):
                        self._advance(search)
                        if search.done:
                            on_done()
                active = [search for search in active if not search.done]
        finally:
            for search in active:
                self._release(search)
        return [BeamSearchOutput(s.prompt, s.prompt_ids, s.finished) for s in searches]

    def _worst_case(self, search: Search) -> int:
        return self.params.beam_width * self.kv.slot_bytes(len(search.prompt_ids) + self.params.max_tokens)

    def _fits(self, search: Search, active: list[Search]) -> bool:
        config = self.engine.config
        slots = (len(active) + 1) * self.params.beam_width <= config.max_slots
        return slots and sum(map(self._worst_case, [*active, search])) <= config.kv_budget

    def _start(self, search: Search) -> Search:
        slot = self._admit(search.prompt_ids)
        computed = self.kv.reuse_prefix(slot, search.prompt_ids)
        search.running.append(Beam(search.prompt_ids, [], 0.0, slot, computed))
        return search

    def _admit(self, token_ids: list[int]) -> int:
        slot = self.kv.admit(min(len(token_ids), self.engine.config.max_batched_tokens))
        if slot is None:  # the worst case was reserved: this is a bug, not a full pool
            raise RuntimeError("the KV store refused a slot that beam search had reserved")
        return slot

    def _iterate(self, beams: list[Beam]) -> None:
        """Computes the beams' pending tokens (decodes and prompt chunks) within the token budget."""
        budget, chunks = self.engine.config.max_batched_tokens, []
        for beam in beams:
            n = min(len(beam.all_ids) - beam.num_computed, budget)
            if n:
                chunks.append((beam, n))
                budget -= n
        self.kv.grow({beam.slot: beam.num_computed + n for beam, n in chunks})
        ends = [beam.num_computed + n == len(beam.all_ids) for beam, n in chunks]
        logits = self.executor.compute([beam for beam, _ in chunks], [n for _, n in chunks], [int(e) for e in ends])
        finished = [beam for (beam, _), end in zip(chunks, ends, strict=True) if end]
        for beam, row in zip(finished, torch.log_softmax(logits, dim=-1), strict=True):
            beam.next_logprobs = row

    def _advance(self, search: Search) -> None:
        """One beam-search step over the running beams' next-token log-probabilities."""
        width, params, running = self.params.beam_width, self.params, search.running
        scores = torch.stack([beam.next_logprobs for beam in running])  # type: ignore[misc]
        scores += torch.tensor([beam.cum_logprob for beam in running])[:, None]
        vocab = scores.shape[1]
        top = scores.flatten().topk(min(self._candidates, scores.numel()))
        candidates = [
            Candidate(running[index // vocab], index % vocab, value)
            for index, value in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
        length = len(running[0].output_ids) + 1
        normalizer = length**params.length_penalty
        ends = [c.token in self._ends or length == params.max_tokens for c in candidates]
        for candidate in (c for c, end in zip(candidates[:width], ends, strict=False) if end):
            ids = candidate.output_ids
            text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
            reason = "stop" if candidate.token in self._ends else "length"
            score = candidate.cum_logprob / normalizer
            search.finished.append(BeamSequence(ids, text, candidate.cum_logprob, score, reason))
        search.finished = sorted(search.finished, key=lambda s: s.score, reverse=True)[:width]
        kept = [c for c, end in zip(candidates, ends, strict=True) if not end][:width]
        full = len(search.finished) == width
        if not kept or (full and kept[0].cum_logprob / normalizer <= search.finished[-1].score):
            search.done = True
            self._release(search)
        else:
            self._branch(search, kept)

    def _branch(self, search: Search, kept: list[Candidate]) -> None:
        """The next running beams, best first: a parent's first continuation takes over its slot,
        the others fork it (or, on a store that cannot fork, compute it again); parents that
        none continues free theirs."""
        first: dict[Beam, int] = {}
        for rank, candidate in enumerate(kept):
            first.setdefault(candidate.parent, rank)
        for beam in search.running:
            if beam not in first:
                self.kv.free(beam.slot)
        children = {rank: kept[rank].child(parent.slot, parent.num_computed) for parent, rank in first.items()}
        search.running = list(children.values())  # what to free if a fork fails
        for rank, candidate in enumerate(kept):
            if rank in children:
                continue
            parent = candidate.parent
            if (slot := self.kv.fork(parent.slot)) is not None:
                children[rank] = candidate.child(slot, parent.num_computed)
            else:
                slot = self._admit(candidate.all_ids)
                children[rank] = candidate.child(slot, self.kv.reuse_prefix(slot, candidate.all_ids))
            search.running.append(children[rank])
        search.running = [children[rank] for rank in range(len(kept))]

    def _release(self, search: Search) -> None:
        for beam in search.running:
            self.kv.free(beam.slot)
        search.running = []

"""Continuous batching with chunked prefill: what runs in the next iteration, and its KV.

Each iteration spends at most `max_batched_tokens`: running requests first (a decode
token, or the next chunk of a prompt), then waiting requests as long as the KV store
admits them. The store grows every slot before the model runs; if it runs out of
pages, the newest running request is preempted (its slot freed, its tokens recomputed
later) and the iteration is planned again.

Admission looks ahead so that preemption stays rare: a request starts only if the store
can hold, at once, its whole prompt and next `reserve_tokens` output tokens and the same
reservation of every running request (each capped at its max_tokens). Admitting on the
first chunk alone lets more requests in than fit, and under a tight budget they evict
each other and compute their prompts again and again. With nothing running, a request
starts as soon as its first chunk fits, so a request larger than the reserve still runs.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from serving.kv_store import KVStore
from serving.request import Request, RequestStatus
from vattn.errors import OutOfPagesError


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one iteration and how many of each one's tokens it computes."""

    requests: list[Request]
    new_tokens: list[int]

    def samples(self, i: int) -> bool:
        """Whether request i's chunk reaches its last token, so the iteration samples for it."""
        request = self.requests[i]
        return request.num_computed + self.new_tokens[i] == request.length


class Scheduler:
    def __init__(self, kv: KVStore, max_batched_tokens: int, max_context: int, reserve_tokens: int) -> None:
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_context = max_context
        self.reserve_tokens = reserve_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Plans the next iteration and grows its slots; None when nothing can run."""
        admit = True
        while True:
            plan = self._plan(admit)
            if not plan:
                return None
            try:
                self.kv.grow({r.slot: r.num_computed + n for r, n in plan if r.slot is not None})
            except OutOfPagesError:
                if len(self.running) <= 1:
                    raise  # one request alone outgrows the pool: the engine sized it wrong
                self._preempt(max(self.running, key=lambda r: r.arrival))
                admit = False  # or the request just preempted could be admitted again
                continue
            return ScheduledBatch([r for r, _ in plan], [n for _, n in plan])

    def _plan(self, admit: bool) -> list[tuple[Request, int]]:
        budget, plan = self.max_batched_tokens, []
        for request in self.running:
            if budget == 0:
                break
            n = self._chunk(request, budget)
            plan.append((request, n))
            budget -= n
        if admit:
            for request in [w for w in self.waiting if self._can_fork(w)]:
                if budget == 0:
                    break
                slot = self.kv.fork(request.fork_of.slot)  # type: ignore[union-attr]
                request.fork_of = None  # forked now, or computed as usual when its turn comes
                if slot is not None:
                    request.num_computed = request.cached_tokens = request.fork_at
                    budget -= self._start(request, slot, budget, plan)
        while admit and self.waiting and budget > 0:
            request = self.waiting[0]
            parent = request.fork_of
            if parent is not None and parent.status is RequestStatus.RUNNING and parent.num_computed < request.fork_at:
                break  # it waits for its parent's prefix, and the queue behind it too
            request.fork_of = None  # its parent went past the fork point, or stopped: computed as usual
            if self.running:
                growing = {r.slot: self._reservation(r) for r in self.running if r.slot is not None}
                slot = self.kv.admit(self._reservation(request), growing)
            else:
                slot = self.kv.admit(min(request.length, budget))
            if slot is None:
                break
            # prompt logprobs need the prompt's logits: computed, not found in the cache
            reuse = not request.wants_prompt_logprobs
            salt = request.params.cache_salt
            request.num_computed = self.kv.reuse_prefix(slot, request.all_ids, salt) if reuse else 0
            if request.cached_tokens is None:  # what usage reports: the first admission's
                request.cached_tokens = min(request.num_computed, len(request.prompt_ids))
            budget -= self._start(request, slot, budget, plan)
        return plan

    def _reservation(self, request: Request) -> int:
        """The tokens a request is promised room for: all it has and `reserve_tokens` more,
        within its max_tokens and the context."""
        end = min(len(request.prompt_ids) + request.params.max_tokens, self.max_context)
        return max(request.length, min(request.length + self.reserve_tokens, end))

    @staticmethod
    def _can_fork(request: Request) -> bool:
        """Whether a waiting request's parent holds exactly the prefix it forks."""
        parent = request.fork_of
        return parent is not None and parent.status is RequestStatus.RUNNING and parent.num_computed == request.fork_at

    def _chunk(self, request: Request, budget: int) -> int:
        """The tokens a running request computes next: the rest, within the budget, but a
        prompt that waiting requests will fork stops at the first fork point ahead."""
        end = request.length
        if request.num_computed < len(request.prompt_ids) - 1:  # fork points lie in prompts, before their end
            points = [w.fork_at for w in self.waiting if w.fork_of is request and w.fork_at > request.num_computed]
            end = min(points, default=end)
        return min(end - request.num_computed, budget)

    def _start(self, request: Request, slot: int, budget: int, plan: list[tuple[Request, int]]) -> int:
        """Moves a waiting request into `slot` and plans its first chunk; returns the chunk's tokens."""
        self.waiting.remove(request)
        request.slot, request.status = slot, RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        self.running.append(request)
        n = self._chunk(request, budget)
        plan.append((request, n))
        return n

    def _preempt(self, request: Request) -> None:
        """Frees a running request's slot; it waits at the front and is recomputed (but for what
        the prefix cache still holds when it is admitted again)."""
        self._release(request)
        request.status, request.num_computed = RequestStatus.WAITING, 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (done or aborted) and frees its slot at once."""
        if request.status is RequestStatus.RUNNING:
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        if request.slot is not None:
            self.kv.free(request.slot)
            request.slot = None


def assign_fork_parents(requests: Sequence[Request], min_tokens: int) -> None:
    """Points each request at the earlier one whose prompt shares the longest prefix with its
    own, to fork it there: always for an equal prompt, else when `min_tokens` are shared.
    Both keep at least their last prompt token to compute (its logits are needed)."""
    earlier: list[tuple[tuple[int, ...], Request]] = []  # sorted: the longest match is a neighbour
    for request in requests:
        if request.params.prompt_logprobs is not None:
            continue  # it computes its whole prompt
        key = tuple(request.prompt_ids)
        at = bisect.bisect(earlier, key, key=lambda entry: entry[0])
        best, point = None, 0
        for _, other in earlier[max(0, at - 1) : at + 1]:
            if other.params.cache_salt != request.params.cache_salt:
                continue  # never shares KV with another tenant
            shared = _common_prefix(other.prompt_ids, request.prompt_ids)
            candidate = min(shared, len(other.prompt_ids) - 1, len(request.prompt_ids) - 1)
            if candidate > point:
                best, point = other, candidate
        while best is not None and best.fork_of is not None and best.fork_at >= point:
            best = best.fork_of  # which computes the prefix itself rather than forking past it
        if best is not None and (best.prompt_ids == request.prompt_ids or point >= min_tokens):
            request.fork_of, request.fork_at = best, point
        earlier.insert(at, (key, request))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

"""Continuous batching with chunked prefill: what runs in the next iteration, and its KV.

Each iteration spends at most `max_batched_tokens`: running requests first (a decode
token, or the next chunk of a prompt), then waiting requests as long as the KV store
admits them. The store grows every slot before the model runs; if it runs out of
pages, the newest running request is preempted (its slot freed, its tokens recomputed
later) and the iteration is planned again.
"""

from __future__ import annotations

from collections import deque
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
    def __init__(self, kv: KVStore, max_batched_tokens: int) -> None:
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
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
        while admit and self.waiting and budget > 0:
            request = self.waiting[0]
            parent = request.fork_of
            if parent is not None and parent.status is RequestStatus.RUNNING:
                if parent.num_computed < len(parent.prompt_ids) - 1:
                    break  # it waits for its parent's prompt, and the queue behind it too
                slot = self.kv.fork(parent.slot) if parent.num_computed == len(parent.prompt_ids) - 1 else None
                request.fork_of = None  # forked now, or (past the fork point) computed as usual
                if slot is not None:
                    request.num_computed = request.cached_tokens = parent.num_computed
                    self._start(request, slot)
                    plan.append((request, 1))
                    budget -= 1
                    continue
            request.fork_of = None
            n = min(request.length, budget)
            slot = self.kv.admit(n)
            if slot is None:
                break
            request.num_computed = self.kv.reuse_prefix(slot, request.all_ids)
            if request.cached_tokens is None:  # what usage reports: the first admission's
                request.cached_tokens = min(request.num_computed, len(request.prompt_ids))
            self._start(request, slot)
            n = self._chunk(request, budget)
            plan.append((request, n))
            budget -= n
        return plan

    def _chunk(self, request: Request, budget: int) -> int:
        """The tokens a running request computes next: the rest, within the budget, but a
        prompt that other choices will fork stops before its last token for them."""
        end = request.length
        if request.num_computed < len(request.prompt_ids) - 1 and self._forks_waiting_on(request):
            end = len(request.prompt_ids) - 1
        return min(end - request.num_computed, budget)

    def _start(self, request: Request, slot: int) -> None:
        self.waiting.popleft()
        request.slot, request.status = slot, RequestStatus.RUNNING
        self.running.append(request)

    def _forks_waiting_on(self, request: Request) -> bool:
        return any(waiting.fork_of is request for waiting in self.waiting)

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

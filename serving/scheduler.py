"""Continuous batching with chunked prefill: what runs in the next iteration, and its KV pages.

Each iteration spends at most `max_batched_tokens`: running requests first (a decode
token, or the next chunk of a prompt), then waiting requests as long as a slot and pages
are free. The KV store maps the iteration's pages before the model runs; if it runs out,
the newest running request is preempted (its slot freed, its tokens recomputed later)
and the iteration is planned again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from serving.sequence import Sequence, Status
from vattn.errors import OutOfPagesError


class KVStore(Protocol):
    """What the engine needs of a KV cache: vattn.KVCache, or a paged baseline."""

    def alloc_reqid(self) -> int: ...

    def free_reqid(self, reqid: int) -> None: ...

    def step(self, seq_lens: Mapping[int, int]) -> None: ...

    def can_admit(self, num_tokens: int) -> bool: ...


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one iteration and how many of each one's tokens it computes."""

    seqs: list[Sequence]
    new_tokens: list[int]

    def samples(self, i: int) -> bool:
        """Whether request i's chunk reaches its last token, so the iteration samples for it."""
        seq = self.seqs[i]
        return seq.num_computed + self.new_tokens[i] == seq.length


class Scheduler:
    def __init__(self, kv: KVStore, max_batched_tokens: int) -> None:
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Plans the next iteration and maps its pages; None when nothing can run."""
        admit = True
        while True:
            plan = self._plan(admit)
            if not plan:
                return None
            try:
                self.kv.step({seq.reqid: seq.num_computed + n for seq, n in plan if seq.reqid is not None})
            except OutOfPagesError:
                if len(self.running) <= 1:
                    raise  # one request alone outgrows the pool: the engine sized it wrong
                self.preempt(max(self.running, key=lambda seq: seq.arrival))
                admit = False  # or the request just preempted could be admitted again
                continue
            return ScheduledBatch([seq for seq, _ in plan], [n for _, n in plan])

    def _plan(self, admit: bool) -> list[tuple[Sequence, int]]:
        budget, plan = self.max_batched_tokens, []
        for seq in self.running:
            if budget == 0:
                break
            n = min(seq.length - seq.num_computed, budget)
            plan.append((seq, n))
            budget -= n
        while admit and self.waiting and budget > 0:
            seq = self.waiting[0]
            n = min(seq.length, budget)
            if not self.kv.can_admit(n):
                break
            self.waiting.popleft()
            seq.reqid, seq.status = self.kv.alloc_reqid(), Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def preempt(self, seq: Sequence) -> None:
        """Frees a running request's slot; it waits at the front and is recomputed from scratch."""
        self._release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a request (done or aborted) and frees its slot at once."""
        if seq.status is Status.RUNNING:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.reqid is not None:
            self.kv.free_reqid(seq.reqid)
            seq.reqid = None

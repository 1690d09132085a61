"""The free list of a paged cache's KV blocks."""

from __future__ import annotations

from collections import deque

from vattn.errors import OutOfPagesError


class BlockPool:
    """Block ids `[0, num_blocks)`; a block is either free here or owned by one request."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` blocks, all or none (OutOfPagesError, nothing taken)."""
        if count > len(self._free):
            raise OutOfPagesError(count, len(self._free))
        return [self._free.popleft() for _ in range(count)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

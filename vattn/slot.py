"""One request slot: a row of every virtual tensor and the pages mapped behind it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Origin(Enum):
    """Who mapped a page step, so stats can say whether a need was met ahead of step()."""

    STEP = "step"
    BACKGROUND = "background"
    REUSED = "reused"


@dataclass
class Slot:
    """Row `index` of every virtual tensor (the reqid of the request it holds).

    `pages[k][b]` is the physical page behind page k of virtual tensor b; pages always
    form a prefix of the slot, so its first `len(pages)` page steps are mapped.
    """

    index: int
    active: bool = False
    length: int = 0
    """Tokens the last step() guaranteed; views of the slot stop here."""
    pages: list[list[int]] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)

"""Stop strings in generated text, at a cost that does not grow with the text.

The engine searches after each token, so a stop string it finds now must end in the
token's new characters: only those and the `longest stop - 1` characters before them
are searched. Likewise only the text's end can be the start of a stop string.
"""

from __future__ import annotations


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in `text`, knowing none is in `text[:-new_chars]`."""
    if not stops or not new_chars:
        return None
    start = max(0, len(text) - new_chars - max(map(len, stops)) + 1)
    return min((i for stop in stops if (i := text.find(stop, start)) >= 0), default=None)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        # the earliest place in the last len(stop) - 1 characters from which the text begins `stop`
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while i >= 0 and not stop.startswith(text[i:]):
            i = text.find(stop[0], i + 1)
        if i >= 0:
            longest = max(longest, len(text) - i)
    return longest

"""Byte sizes: the binary units, and sizes written as people write them ('64K', '2MiB')."""

from __future__ import annotations

import re

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB}


def parse_size(text: str) -> int:
    """Bytes from '65536', '64K', '64KiB', '2M', '512MB', '1G' (units are binary); ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not a size such as 65536, 64K, 512MiB or 1G")
    return int(match[1]) * UNITS[match[2]]


def size_label(nbytes: int) -> str:
    """The shortest exact label: 2097152 -> '2M', 65536 -> '64K', 1000 -> '1000'."""
    for unit, scale in (("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)

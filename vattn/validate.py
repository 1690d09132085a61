"""Checks of caller-given numbers, shared by the allocator and the engine: plain ints only."""

from __future__ import annotations


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def exact_int(value: object, name: str, low: int, high: int) -> int:
    """`value` as a plain int in [low, high], or ValueError naming it.

    An int subclass is read by the number it stores: its own comparisons, hash and
    `__index__` could make one reqid look like two, so they are never consulted.
    """
    if type(value) is int and low <= value <= high:  # the common case, first
        return value
    if not is_int(value):
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    number = int.__index__(value)  # type: ignore[arg-type]
    if not low <= number <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {number}")
    return number


def require_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

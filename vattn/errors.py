"""Errors callers handle: capacity (queue, preempt, retry) and features missing on this machine."""


class CapacityError(RuntimeError):
    """The cache cannot take more work right now; nothing was changed."""


class OutOfPagesError(CapacityError):
    """A step needs more physical pages than are free or reclaimable."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(
            f"step needs {needed} more physical pages but only {available} are free or "
            "reclaimable; no slot was changed (preempt a request and retry)"
        )
        self.needed = needed
        self.available = available


class OutOfSlotsError(CapacityError):
    """Every request slot (reqid) is in use."""

    def __init__(self, max_slots: int, held_by_views: int = 0) -> None:
        held = f" ({held_by_views} freed ones wait for their old views to be dropped)" if held_by_views else ""
        super().__init__(f"all {max_slots} request slots are in use{held}; free a reqid first")
        self.max_slots = max_slots
        self.held_by_views = held_by_views


class ConfigurationError(ValueError):
    """A configuration this machine cannot hold (address space, vm.max_map_count), refused before
    anything is built; the message names the limit and the fix."""


class UnavailableError(RuntimeError):
    """A backend, kernel or model was asked for whose library, device or files are missing here."""

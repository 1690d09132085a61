"""The background thread that maps pages ahead of the model (the paper's overlap)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundMapper:
    """Runs `work` whenever woken until it reports nothing left to do.

    `work` does one bounded batch (of map calls) per call and returns whether it did
    anything, so a `step()` waiting on the cache lock waits for one batch at most. The thread
    holds `work`'s object only while working, so a cache nobody else holds is collected
    (and the thread stops with it).
    """

    def __init__(self, work: weakref.WeakMethod[Callable[[], bool]]) -> None:
        self._work = work
        self._wake = threading.Condition()
        self._pending = False
        self._busy = False
        self._stopping = False
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="vattn-mapper", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._wake:
            self._pending = True
            self._wake.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until every wake so far has been worked off; False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: not (self._pending or self._busy), timeout)

    def close(self) -> None:
        """Stops the thread; waits for it unless called from it (the cache collected there)."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def after_fork_in_child(self) -> None:
        """A forked child has no mapper thread: a fresh condition (the old one's lock may be held)."""
        self._wake = threading.Condition()
        self._stopping = True

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._stopping)
                if self._stopping:
                    return
                self._pending, self._busy = False, True
            self._work_off()
            with self._wake:
                self._busy = False
                self._wake.notify_all()

    def _work_off(self) -> None:
        work = self._work()
        if work is None:
            return
        try:
            while not self._stopping and work():
                pass
        except Exception:  # the sync path in step() still guarantees correctness
            self.errors += 1
            log.exception("background mapping failed; step() will map synchronously")

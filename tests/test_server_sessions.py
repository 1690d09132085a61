"""measure.servers' control of a server's session, with which benchmarks.serving_compare pauses the
servers it is not measuring: a real process in a session of its own, paused, continued, and
stopped while paused."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from measure.servers import pause_session, session_members, stop_session


def states(sid: int) -> set[str]:
    """The process states (proc(5)'s field 3) of session `sid`'s members."""
    found = set()
    for pid, _, _ in session_members(sid):
        with contextlib.suppress(OSError):  # gone since it was listed
            found.add(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
    return found


def settles(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_a_paused_session_is_stopped_continued_and_still_ends_on_sigterm() -> None:
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert settles(lambda: states(process.pid) == {"S"})
        pause_session(process.pid, True)
        assert settles(lambda: states(process.pid) == {"T"})
        pause_session(process.pid, False)
        assert settles(lambda: states(process.pid) == {"S"})
        pause_session(process.pid, True)
        assert settles(lambda: states(process.pid) == {"T"})
        stop_session(process, grace=10)  # continues it first: a stopped process would not act on SIGTERM
        assert process.returncode == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

"""Servers a benchmark starts: each in a session of its own on a free loopback port, waited on
until /health answers, its process tree's RSS and CPU time read from /proc, and the whole session
stopped on leaving (a peer's engine processes outlive their leader)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
from tqdm import tqdm

from measure.results import exit_on_sigterm, free_port
from vattn.sizes import MiB

PAGE = os.sysconf("SC_PAGE_SIZE")


def session_members(sid: int) -> list[tuple[int, int, int]]:
    """(pid, RSS bytes, CPU ticks used) of every process in session `sid`, from /proc/*/stat."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # fields[0] is field 3 of proc(5)
            if int(fields[3]) == sid:
                members.append((int(stat.parent.name), int(fields[21]) * PAGE, int(fields[11]) + int(fields[12])))
        except (OSError, ValueError, IndexError):
            pass
    return members


def server_ticks(sid: int) -> int:
    return sum(ticks for _, _, ticks in session_members(sid))


def server_share(sid: int, ticks_before: int, since: float) -> float:
    """The server's share of the machine's CPU time since `since` (time.monotonic())."""
    available = os.sysconf("SC_CLK_TCK") * (time.monotonic() - since) * (os.cpu_count() or 1)
    return (server_ticks(sid) - ticks_before) / available


class TreeRss:
    """Polls the summed RSS of a server's session in a thread; `take()` returns the peak since the last."""

    def __init__(self, sid: int, interval: float = 0.2) -> None:
        self.sid, self.interval, self.peak = sid, interval, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, sum(rss for _, rss, _ in session_members(self.sid)))

    def take(self) -> float:
        peak, self.peak = self.peak, sum(rss for _, rss, _ in session_members(self.sid))
        return round(max(peak, self.peak) / MiB, 1)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def pause_session(sid: int, paused: bool) -> None:
    """SIGSTOP (or SIGCONT) to every process of session `sid`: a benchmark pauses the servers it is
    not measuring, whose idle timers and pollers would otherwise take the measured one's CPU."""
    for pid, _, _ in session_members(sid):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)


def stop_session(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (continued first: a paused one would not act on it),
    SIGKILL to whatever is left after `grace` seconds."""
    pause_session(process.pid, False)
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and session_members(process.pid):
        process.poll()  # reaps the leader so that it leaves the session
        time.sleep(0.2)
    if session_members(process.pid):
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def started(
    name: str, command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes], float]]:
    """A server (`command`, "{port}" standing for a free loopback port; `env` on top of this
    process's) in a session of its own, its output in `log`, until it answers its /health: (url,
    process, seconds). Its whole session is stopped on leaving."""
    exit_on_sigterm()
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in command]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url, begun = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        with tqdm(desc=f"starting {name}", unit="s", bar_format="{desc}: {elapsed}") as bar:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"exited with {process.returncode} while starting:\n{log_tail(log)}")
                if time.monotonic() - begun > timeout:
                    raise RuntimeError(f"no answer on /health after {timeout:.0f} s:\n{log_tail(log)}")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(1)
                bar.update()
        yield url, process, time.monotonic() - begun
    finally:
        stop_session(process)


@contextmanager
def local_server(serve_args: str = "") -> Iterator[str]:
    """`vattn serve` with these options, started as `started` starts one: its URL."""
    command = [sys.executable, "-m", "serving.server.cli", "serve", "--port", "{port}", *serve_args.split()]
    with (
        tempfile.TemporaryDirectory(prefix="vattn-serve-") as logs,
        started("vattn", command, Path(logs) / "serve.log", timeout=300) as (url, _, _),
    ):
        yield url

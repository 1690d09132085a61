"""`vattn replicas`: N `vattn serve` processes on one machine behind an existing router.

The routing is the router's (vllm-router or SMG, each installed in its own virtualenv by `make
router`); this module only starts the replicas, waits until each answers /health, starts the
router with their URLs, and stops them all together. A replica that dies is reported and left
down: the router's health checks and retries take it out, so it costs only the requests it
held. Across machines, start `vattn serve` on each and give the router their URLs yourself
(README, "Scaling out").
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger("vattn.replicas")

ROUTERS = ("vllm-router", "smg")
ROUTER_VENV = Path(sys.prefix).parent / ".peers" / "router"
"""Where `make router` installs the routers (beside the project's .venv)."""
ROUTER_HEALTH = (
    *("--health-check-interval-secs", "2", "--health-failure-threshold", "2"),
    *("--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "5"),
)
"""Probe every 2 s and take a replica out after 2 failed probes or 3 failed requests, and try one
whose requests failed again after 5 s (the routers' defaults, 60 s x 3, 10 and 60 s, leave a dead
replica in the rotation for minutes, and a woken or restarted one out of it for a minute)."""


@dataclass(frozen=True)
class ReplicaPlan:
    replicas: int
    router: str
    policy: str
    host: str
    port: int
    first_port: int
    serve_args: tuple[str, ...]
    cpus_per_replica: int | None = None
    """Pin replica i to CPUs [i*k, (i+1)*k) with k torch threads; None: share them all."""
    router_bin: str | None = None
    router_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.port in self.replica_ports:
            raise ValueError(f"the router's port {self.port} is one of the replicas' ({self.replica_ports})")
        if self.cpus_per_replica is not None:
            cpus = len(os.sched_getaffinity(0))
            if self.cpus_per_replica < 1 or self.replicas * self.cpus_per_replica > cpus:
                need = self.replicas * self.cpus_per_replica
                raise ValueError(
                    f"{self.replicas} replicas x {self.cpus_per_replica} CPUs need {need} CPUs; this process may "
                    f"use {cpus}: lower --cpus-per-replica or --replicas"
                )

    @property
    def replica_ports(self) -> list[int]:
        return [self.first_port + index for index in range(self.replicas)]

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.replica_ports]

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def find_router(name: str, explicit: str | None) -> str:
    """The router's executable: `explicit`, else on PATH, else in `make router`'s virtualenv."""
    for candidate in (explicit, shutil.which(name), str(ROUTER_VENV / "bin" / name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    where = f"--router-bin {explicit} is not an executable" if explicit else f"{name} is not on PATH"
    raise FileNotFoundError(f"{where}: `make router` installs vllm-router, `make router-smg` smg, into {ROUTER_VENV}")


def router_command(plan: ReplicaPlan, executable: str) -> list[str]:
    """The router's command line: its own flags for the workers, policy, address and health checks."""
    launch = ["launch"] if plan.router == "smg" else []
    own = ["--disable-tokenizer-autoload"] if plan.router == "smg" else ["--prometheus-port", str(plan.port + 1000)]
    return [
        executable,
        *launch,
        "--worker-urls",
        *plan.replica_urls,
        "--policy",
        plan.policy,
        "--host",
        plan.host,
        "--port",
        str(plan.port),
        *ROUTER_HEALTH,
        *own,
        *plan.router_args,
    ]


class ReplicaSet:
    """The replicas and the router as child processes; `stop` ends them all."""

    def __init__(self, plan: ReplicaPlan, router_output: int | None = None) -> None:
        """`router_output`: where the router's log goes (subprocess.PIPE to read it), else ours."""
        self.plan = plan
        self._router_output = router_output
        self.replicas: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 600.0) -> None:
        """Starts the replicas, waits for each /health, then starts the router; on any failure
        stops what started and raises."""
        executable = find_router(self.plan.router, self.plan.router_bin)
        try:
            for index, port in enumerate(self.plan.replica_ports):
                self.replicas.append(self._start_replica(index, port))
            self._wait_healthy(timeout)
            output = self._router_output
            self.router = subprocess.Popen(
                router_command(self.plan, executable),
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                text=output is not None,
            )
            print(f"router: pid {self.router.pid} http://{self.plan.host}:{self.plan.port}", flush=True)
            self._wait_router(timeout)
        except BaseException:
            self.stop()
            raise
        print(f"ready: {self.plan.replicas} replicas behind {self.plan.router} ({self.plan.policy})", flush=True)

    def _start_replica(self, index: int, port: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        cpus: set[int] | None = None
        if (k := self.plan.cpus_per_replica) is not None:
            cpus = set(sorted(os.sched_getaffinity(0))[index * k : (index + 1) * k])
            env["OMP_NUM_THREADS"] = str(k)
        command = [sys.executable, "-m", "serving.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        process = subprocess.Popen(
            [*command, *self.plan.serve_args],
            env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        pinned = f", CPUs {sorted(cpus)}" if cpus else ""
        print(f"replica {index}: pid {process.pid} http://127.0.0.1:{port}{pinned}", flush=True)
        return process

    def _wait_healthy(self, timeout: float) -> None:
        deadline, waiting = time.monotonic() + timeout, dict(enumerate(self.replicas))
        while waiting:
            for index, process in list(waiting.items()):
                if process.poll() is not None:
                    raise RuntimeError(f"replica {index} exited with code {process.returncode} before it was ready")
                if _answers(f"{self.plan.replica_urls[index]}/health"):
                    del waiting[index]
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas {sorted(waiting)} were not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def _wait_router(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.router is not None
        while not _answers(f"{self.plan.router_url}/health"):
            if self.router.poll() is not None:
                raise RuntimeError(f"{self.plan.router} exited with code {self.router.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.plan.router} did not answer /health after {timeout:.0f} s")
            time.sleep(0.5)

    def watch(self, stop: threading.Event) -> int:
        """Reports replicas that exit and returns when `stop` is set (0) or the router exits (1)."""
        reported: set[int] = set()
        while not stop.wait(0.5):
            for index, process in enumerate(self.replicas):
                if process.poll() is not None and index not in reported:
                    reported.add(index)
                    log.warning("replica %d exited with code %s; the router takes it out", index, process.returncode)
            if self.router is not None and self.router.poll() is not None:
                log.error("%s exited with code %s", self.plan.router, self.router.returncode)
                return 1
        return 0

    def stop(self, grace: float = 30.0) -> None:
        """The router first (no new requests), then the replicas: SIGTERM, SIGKILL after `grace` s."""
        for group in ([self.router] if self.router else [], self.replicas):
            for process in group:
                if process.poll() is None:
                    process.terminate()
            deadline = time.monotonic() + grace
            for process in group:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def free_port_run(count: int) -> int:
    """The first of `count` consecutive loopback ports nobody listens on."""
    for base in range(20_000 + os.getpid() % 1000 * 20, 60_000, 20):
        try:
            sockets = [socket.create_server(("127.0.0.1", base + k)) for k in range(count)]
        except OSError:
            continue
        for sock in sockets:
            sock.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def run(plan: ReplicaPlan) -> int:
    """Starts the set and keeps it until SIGINT/SIGTERM or the router's exit; the exit code."""
    replicas, stop = ReplicaSet(plan), threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    replicas.start()
    try:
        return replicas.watch(stop)
    finally:
        replicas.stop()


def parse_serve_args(argv: Sequence[str]) -> tuple[str, ...]:
    """The `vattn serve` options after `--`; the launcher sets each replica's --host and --port."""
    for option in ("--host", "--port"):
        if any(arg == option or arg.startswith(f"{option}=") for arg in argv):
            raise ValueError(f"{option} is set for each replica by the launcher; give the router's with --host/--port")
    return tuple(argv)

"""The peer systems' venvs under .peers/ (`make peers`): where they are, what is installed in
them, how vLLM's CPU build is run (its environment), and how a driver script runs inside one,
for every benchmark that runs a peer."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress
from pathlib import Path

from measure.results import REPO_ROOT

PEERS = REPO_ROOT / ".peers"


def dist_version(venv: Path, dist: str) -> str:
    """The version of distribution `dist` installed in `venv`, read from its .dist-info name."""
    found = sorted(venv.glob(f"lib/python*/site-packages/{dist.replace('-', '_')}-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-")[1] if found else "?"


def missing(*paths: Path, target: str) -> str | None:
    absent = [str(p) for p in paths if not p.exists()]
    return f"not installed ({', '.join(absent)} missing): run `make {target}`" if absent else None


KV_SPACE_GIB = 2
"""Every system's KV space in the comparisons: vLLM's VLLM_CPU_KVCACHE_SPACE, OpenVINO's
cache_size, vattn's kv_budget. 48 x 576 tokens need 1.3 GiB in fp32, more than vattn's
default budget (1 GiB), which would otherwise queue requests that the peers run at once."""


def vllm_env(venv: Path) -> dict[str, str]:
    """vLLM's CPU build's environment: offline, KV_SPACE_GIB of KV space, both cores computing
    (by default one is kept for the frontend), and TCMalloc and Intel's OpenMP (a dependency of
    vllm-cpu) preloaded, as its CPU docs say and its worker warns when they are not."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    preload = [*sorted(venv.glob("tcmalloc/usr/lib/*/libtcmalloc_minimal.so.4")), *venv.glob("lib/libiomp5.so")]
    if preload:
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    return env


def run_driver(command: list[str], env: dict[str, str] | None = None) -> None:
    """Runs a peer's driver script in a session of its own, then kills what is left of that
    session: vLLM's engine processes outlive a driver that leaves with os._exit (found still
    resident, 4 GiB and a spinning worker, under the next benchmark's systems)."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        process.wait()
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)

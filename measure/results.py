"""Shared helpers: where results go, machine facts, CSV/JSON writers, tables, percentiles, a local server."""

from __future__ import annotations

import csv
import datetime
import json
import mmap
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from measure import onednn
from serving.model.cpu_features import cpu_flags, cpu_kernels
from vattn.sizes import KiB, MiB

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def command_line() -> str:
    """The exact command that started this process, as one would type it."""
    argv = list(sys.argv)
    script = Path(argv[0]).resolve() if argv and argv[0].endswith(".py") else None
    parts = script.relative_to(REPO_ROOT).with_suffix("").parts if script and script.is_relative_to(REPO_ROOT) else ()
    if len(parts) > 1 and (REPO_ROOT / parts[0] / "__init__.py").exists():
        # A module of this repository's packages (benchmarks.X, paper_repro.X, paper_repro's __main__).
        module = ".".join(parts).removesuffix(".__main__")
        argv = ["python", "-m", module, *argv[1:]]
    else:
        argv = ["python", *argv]
    return shlex.join(argv)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


MEASURED_CODE = ("vattn", "native", "serving", "benchmarks", "measure")


def _git_dirty() -> bool | None:
    try:
        out = subprocess.run(
            # the code that measures and is measured; not the results files a run writes as it goes, nor prose
            ["git", "status", "--porcelain", "--", *MEASURED_CODE, ":(exclude)benchmarks/results", ":(exclude)*.md"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip())


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> list[str]:
    """The CPU's SIMD flags that decide which kernels are fast here (AVX2, AVX-512 and its
    VNNI/BF16, AMX, FMA)."""
    return sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * KiB
    except (OSError, ValueError):
        pass
    return None


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
"""Environment variables that hold torch, oneDNN and MKL below the CPU's widest instructions."""


def machine_facts() -> dict[str, Any]:
    """os.uname(), core counts, CPU flags, the oneDNN ISA and kernels vattn's projections run on
    (measure.onednn), memory, versions and the run's date."""
    uname = os.uname()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "uname": {
            "sysname": uname.sysname,
            "nodename": uname.nodename,
            "release": uname.release,
            "version": uname.version,
            "machine": uname.machine,
        },
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vattn_kernels": cpu_kernels(),
        "isa_limits": {name: os.environ[name] for name in ISA_LIMITS if name in os.environ},
        "onednn": onednn.facts(),
        "mem_total_bytes": _mem_total_bytes(),
        "page_size_os": os.sysconf("SC_PAGE_SIZE"),
        "max_map_count": int(Path("/proc/sys/vm/max_map_count").read_text()),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),  # the measured code (vattn, native, serving, benchmarks, measure) had changes
    }


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Writes dict rows with the union of their keys as the header (first-seen order)."""
    fields: list[str] = []
    for row in rows:
        fields += [key for key in row if key not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def save_figure(fig: Any, path: Path, title: str) -> None:
    """Titles, lays out, writes (PNG, 120 dpi) and closes a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_results(
    out: Path, name: str, rows: Sequence[Mapping[str, Any]], payload: Mapping[str, Any]
) -> tuple[Path, Path, Path]:
    """Writes `rows` to `out/name.csv` and `payload` to `out/name.json`; returns those two paths
    and `out/name.png`, where the caller's plot goes."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = (out / f"{name}.{ext}" for ext in ("csv", "json", "png"))
    write_csv(csv_path, rows)
    write_json(json_path, payload)
    return csv_path, json_path, png_path


def print_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, int, str]], title: str = ""
) -> None:
    """Prints a blank line, `title` (when given), the right-aligned headers, then one line per row.

    A column is (header, key, width, format spec after the width: "" or e.g. ".1f"); a value
    that is None or missing is printed blank.
    """
    header = " ".join(f"{name:>{width}}" for name, _, width, _ in columns)
    print(f"\n{title}\n{header}" if title else f"\n{header}")
    for row in rows:
        cells = (
            f"{'':>{width}}" if row.get(key) is None else format(row[key], f">{width}{spec}")
            for _, key, width, spec in columns
        )
        print(" ".join(cells))


def ratio_range(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Round-by-round ratios of two systems' speeds (paired by round): their median and range. A
    lead or a shortfall is claimed only where the range stays on one side of 1."""
    ratios = sorted(a / b for a, b in zip(ours, theirs, strict=True))
    middle = len(ratios) // 2
    median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    return {"median": median, "min": ratios[0], "max": ratios[-1]}


def percentiles(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """p50, p90, p99, max and mean of a sample."""
    arr = np.asarray(values, dtype=np.float64)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
        "mean": float(arr.mean()),
    }


class CpuShare:
    """How much of the machine's CPU time went to other processes while a block ran.

    The machines are shared and noisy: a high `other_share` means the numbers taken
    meanwhile were squeezed by someone else's work. Reads /proc/stat and /proc/self/stat.
    """

    def __init__(self) -> None:
        self._start = self._read()
        self.result: dict[str, float] = {}

    @staticmethod
    def _read() -> tuple[float, float, float]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields[:8]]
        total = float(sum(ticks))
        busy = total - ticks[3] - ticks[4]  # minus idle and iowait
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        mine = float(int(own[11]) + int(own[12]))  # utime + stime
        return total, busy, mine

    def stop(self) -> dict[str, float]:
        """Shares of all CPU time: busy, ours, others'; plus the 1-minute load average."""
        total, busy, mine = (end - start for end, start in zip(self._read(), self._start, strict=True))
        total = max(total, 1.0)
        self.result = {
            "busy_share": busy / total,
            "own_share": mine / total,
            "other_share": max(0.0, busy - mine) / total,
            "loadavg_1min": os.getloadavg()[0],
        }
        return self.result


def prewarm_memory(nbytes: int, chunk: int = 64 * MiB) -> dict[str, Any]:
    """Touches then frees `nbytes` of anonymous memory; returns the first-touch GB/s seen.

    On these VMs guest RAM that was never touched since boot costs the hypervisor a fault
    of its own on first touch (about 5x slower here), and freed guest pages stay backed.
    Touching and freeing enough memory first makes a benchmark's fresh pages measure the
    kernel's allocation, not the VM's history; the chunk rates show how cold the VM was.
    """
    if nbytes <= 0:
        return {"bytes": 0}
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    regions, rates = [], []
    started = time.perf_counter()
    try:
        for _ in range(max(1, nbytes // chunk)):
            region = mmap.mmap(-1, chunk)
            view = torch.frombuffer(region, dtype=torch.uint8)
            t0 = time.perf_counter()
            view.fill_(1)
            rates.append(chunk / (time.perf_counter() - t0) / 1e9)
            del view
            regions.append(region)
    finally:
        for region in regions:
            region.close()
        torch.set_num_threads(saved)
    return {
        "bytes": len(rates) * chunk,
        "seconds": time.perf_counter() - started,
        "median_chunk_gbps": float(np.median(rates)),
        "min_chunk_gbps": float(min(rates)),
        "max_chunk_gbps": float(max(rates)),
        "chunk_gbps": [round(r, 3) for r in rates],
    }


def free_port() -> int:
    """A loopback TCP port nobody listens on (for a server started next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def exit_on_sigterm() -> None:
    """Makes SIGTERM (a `timeout`, a killed job) unwind this process as an exception would, so that
    the servers a benchmark started are stopped by its context managers instead of outliving it
    and loading the machine under the next measurement (Python's default is to die at once)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))

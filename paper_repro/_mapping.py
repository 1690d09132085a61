"""Shared by the allocation-bandwidth experiments (Table 7: `allocation` on the host,
`gpu_allocation` on CUDA): batches of pages, timed runs repeated per page size and call
path, their medians, table columns and page-size figures."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from vattn.sizes import size_label

MODES = ("fresh", "recycled")
"""A run maps pages never touched, then the same pages again at other addresses."""


def batched(items: Sequence[int], size: int) -> list[Sequence[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def timed_batches(call: Callable[[Sequence[int]], Any], batches: list[Sequence[int]]) -> float:
    """Seconds to run `call` over every batch."""
    started = time.perf_counter()
    for batch in batches:
        call(batch)
    return time.perf_counter() - started


def run_fields(page_size: int, path: str, mode: str, pages: int, batch: int) -> dict[str, Any]:
    """The leading columns of one mapping run's row: what was mapped, how, in what batches."""
    return {
        "page_size": page_size,
        "page_label": size_label(page_size),
        "path": path,
        "mode": mode,
        "pages": pages,
        "bytes": pages * page_size,
        "batch": batch,
    }


def repeated_runs(
    reps: int,
    page_sizes: Sequence[int],
    paths: Sequence[str],
    run: Callable[[int, str], list[dict[str, Any]]],
    desc: str,
) -> list[dict[str, Any]]:
    """`run(page_size, path)` for every repetition x page size x call path (a progress bar over
    them); its rows, each tagged with its repetition as "rep"."""
    raw: list[dict[str, Any]] = []
    jobs = [(rep, ps, path) for rep in range(reps) for ps in page_sizes for path in paths]
    for rep, ps, path in tqdm(jobs, desc=desc, unit="run"):
        raw += [{"rep": rep, **row} for row in run(ps, path)]
    return raw


def summarize_runs(raw: list[dict[str, Any]], timings: Sequence[str], per_page: Sequence[str]) -> list[dict[str, Any]]:
    """Median of every timing over the repetitions of each (page size, path, mode).

    `timings` are seconds per run, among them "map_s" and "total_s": each gets a
    `median_<key>` column; GB/s come from the median total (`gbps`, with the runs' min and
    max), the median map (`map_only_gbps`) and each other timing (`<name>_gbps`, None
    where its median is 0). `per_page` columns are medians over the runs that have them.
    """
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for row in raw:
        groups.setdefault((row["page_size"], row["path"], row["mode"]), []).append(row)
    summary = []
    for (page_size, path, mode), rows in sorted(groups.items()):
        nbytes = rows[0]["bytes"]
        med = {key: statistics.median(r[key] for r in rows) for key in timings}
        out: dict[str, Any] = {
            "page_size": page_size,
            "page_label": size_label(page_size),
            "path": path,
            "mode": mode,
            "pages": rows[0]["pages"],
            "bytes": nbytes,
            "reps": len(rows),
            **{f"median_{key}": value for key, value in med.items()},
            "gbps": nbytes / med["total_s"] / 1e9,
            "gbps_min": min(r["gbps"] for r in rows),
            "gbps_max": max(r["gbps"] for r in rows),
            "map_only_gbps": nbytes / med["map_s"] / 1e9,
        }
        for key in timings:
            if key not in ("map_s", "total_s"):
                out[f"{key.removesuffix('_s')}_gbps"] = nbytes / med[key] / 1e9 if med[key] else None
        for key in per_page:
            values = [r[key] for r in rows if r.get(key) is not None]
            out[key] = statistics.median(values) if values else None
        summary.append(out)
    return summary


def run_columns(path_width: int) -> list[tuple[str, str, int, str]]:
    """`print_table` columns naming a summary row: page size, call path, mode."""
    return [("page", "page_label", 5, ""), ("path", "path", path_width, ""), ("mode", "mode", 9, "")]


def per_page_columns(spec: str, calls: Mapping[str, str]) -> list[tuple[str, str, int, str]]:
    """`print_table` columns "<short> us/pg" of the summary's `<call>_us_per_page`, for each
    short name -> call, one character wider than their header."""
    return [(f"{short} us/pg", f"{call}_us_per_page", len(short) + 7, spec) for short, call in calls.items()]


def page_size_figure(height: float) -> tuple[Any, Any, Any]:
    """A figure with a wide bandwidth panel and a narrower per-page-cost panel: (fig, ax, ax_lat)."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_lat) = plt.subplots(1, 2, figsize=(13, height), gridspec_kw={"width_ratios": [3, 2]})
    return fig, ax, ax_lat


def label_page_size_axes(
    summary: Sequence[Mapping[str, Any]], panels: Sequence[tuple[Any, str, str, Mapping[str, Any]]]
) -> None:
    """Each panel `(axis, y label, title, legend options)`: a log-2 page-size x axis ticked at
    the summary's page sizes, a grid, its labels and its legend."""
    page_sizes = sorted({row["page_size"] for row in summary})
    for axis, ylabel, title, legend in panels:
        axis.set_xscale("log", base=2)
        axis.set_xticks(page_sizes, [size_label(p) for p in page_sizes])
        axis.set_xlabel("page size")
        axis.grid(True, which="both", alpha=0.3)
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.legend(**legend)

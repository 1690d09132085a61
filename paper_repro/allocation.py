"""Table 7, allocation bandwidth: physical mapping bandwidth of the host backend (on Linux).

For each page size and each call path (the C batch call, "native", or one ctypes call
per page), a new `HostBackend` (a new memfd, so its pages were never touched) maps and
populates `total` bytes: that is "fresh" allocation. The same pool pages are then
unmapped and mapped + populated again at other addresses: "recycled". Pages are mapped
in reversed pool order, so no two neighbouring mappings merge, as in the KV cache where
consecutive pool pages go to different tensors. GB/s = bytes / (map + populate seconds).

The same run measures what the machine can fill: `fill_` over already-faulted memory
and first-touch fills of fresh anonymous and fresh memfd mappings.

    python -m paper_repro.allocation [--quick] [--reps 7] [--page-sizes 4K,64K,256K,2M]

`--quick` maps 4 MiB of 64K and 2M pages once each (a few seconds). The GPU version is
paper_repro.gpu_allocation.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import torch
from tqdm import tqdm

from measure.results import (
    CpuShare,
    command_line,
    machine_facts,
    prewarm_memory,
    print_table,
    save_figure,
    write_results,
)
from paper_repro import _mapping as mapping
from paper_repro._harness import results_dir
from vattn.backends.host import MAP_COUNT_HEADROOM, HostBackend, current_map_count, max_map_count
from vattn.backends.native import native_available
from vattn.sizes import MiB, parse_size, size_label

QUICK = {"page_sizes": "64K,2M", "total": "4M", "small_total": "4M", "reps": 1, "prewarm_mib": 0}
"""The defaults `--quick` sets."""


def pages_for_run(page_size: int, total: int) -> int:
    """Pages of one run: `total` bytes, cut to what vm.max_map_count allows the backend."""
    pages = max(1, total // page_size)
    allowed = (max_map_count() - current_map_count() - MAP_COUNT_HEADROOM - 1) // 2 - 64
    return min(pages, allowed)


def one_run(page_size: int, pages: int, native: bool, batch: int) -> list[dict[str, Any]]:
    """Fresh then recycled map + populate of `pages` pages on a new backend; one row per mode."""
    nbytes = pages * page_size
    backend = HostBackend(page_size, pages, reservations=1, reservation_bytes=2 * nbytes, native=native)
    base = backend.reserve(2 * nbytes)  # room to map the recycled pages at other addresses
    rows: list[dict[str, Any]] = []
    try:
        pool = backend.create_pages(pages)
        # Page i at slot pages-1-i: reversed offsets, so neighbouring mappings never merge.
        fresh_addrs = [base + (pages - 1 - i) * page_size for i in range(pages)]
        recycled_addrs = [base + nbytes + (pages - 1 - i) * page_size for i in range(pages)]
        unmap_s = 0.0
        for mode, addrs in (("fresh", fresh_addrs), ("recycled", recycled_addrs)):
            addr_batches = mapping.batched(addrs, batch)
            pairs = list(zip(addr_batches, mapping.batched(pool, batch), strict=True))
            started = time.perf_counter()
            for addr_batch, page_batch in pairs:
                backend.map(addr_batch, page_batch)
            map_s = time.perf_counter() - started
            done = 0

            def populate(addr_batch: Sequence[int]) -> None:
                nonlocal done
                done += backend.populate(addr_batch)

            populate_s = mapping.timed_batches(populate, addr_batches)
            if done != pages:
                raise RuntimeError(f"populate did {done} of {pages} pages")
            if mode == "fresh":
                unmap_s = mapping.timed_batches(backend.unmap, addr_batches)
            rows.append(
                {
                    **mapping.run_fields(page_size, backend.calls.name, mode, pages, batch),
                    "map_s": map_s,
                    "populate_s": populate_s,
                    "total_s": map_s + populate_s,
                    "gbps": nbytes / (map_s + populate_s) / 1e9,
                    "map_only_gbps": nbytes / map_s / 1e9,
                    "populate_gbps": nbytes / populate_s / 1e9,
                    "map_us_per_page": map_s / pages * 1e6,
                    "populate_us_per_page": populate_s / pages * 1e6,
                    "unmap_us_per_page": unmap_s / pages * 1e6 if mode == "fresh" else None,
                }
            )
        backend.unmap(recycled_addrs)
    finally:
        backend.free_reservation(base, 2 * nbytes)
        backend.close()  # closing the only reference to the memfd frees its pages
    return rows


def fill_bandwidth(nbytes: int, reps: int, threads: int) -> dict[str, float]:
    """GB/s of torch fill_ over faulted memory and first-touch fills of fresh mappings."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        faulted = torch.empty(nbytes, dtype=torch.uint8)
        faulted.fill_(0)
        times = []
        for i in range(reps):
            started = time.perf_counter()
            faulted.fill_(i + 1)
            times.append(time.perf_counter() - started)
        del faulted
        anon, memfd = [], []
        for i in range(reps):
            anon.append(_first_touch(mmap.mmap(-1, nbytes), i + 1))
            fd = os.memfd_create("vattn-bench-fill", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                memfd.append(_first_touch(mmap.mmap(fd, nbytes), i + 1))
            finally:
                os.close(fd)
    finally:
        torch.set_num_threads(saved)
    return {
        "fill_faulted_gbps": nbytes / statistics.median(times) / 1e9,
        "first_touch_anon_gbps": nbytes / statistics.median(anon) / 1e9,
        "first_touch_memfd_gbps": nbytes / statistics.median(memfd) / 1e9,
    }


def _first_touch(region: mmap.mmap, value: int) -> float:
    """Seconds to fill a freshly mapped region whose pages were never touched."""
    try:
        view = torch.frombuffer(region, dtype=torch.uint8)
        started = time.perf_counter()
        view.fill_(value)
        elapsed = time.perf_counter() - started
        del view
    finally:
        region.close()
    return elapsed


def summarize(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median of every timing over the repetitions of each (page size, path, mode)."""
    return mapping.summarize_runs(
        raw, ("map_s", "populate_s", "total_s"), ("map_us_per_page", "populate_us_per_page", "unmap_us_per_page")
    )


def plot(
    summary: list[dict[str, Any]], fills: dict[str, dict[str, float]], threads: int, path: Path, title: str
) -> None:
    """GB/s vs page size per path x mode with fill bandwidths (largest size), and map latency per page.

    Populate runs in one thread, so the 1-thread first-touch line is its natural ceiling.
    """
    fig, ax, ax_lat = mapping.page_size_figure(6.4)
    styles = {"fresh": "-", "recycled": "--"}
    colors = {"native": "tab:blue", "ctypes": "tab:orange"}
    for path_name in ("native", "ctypes"):
        for mode in mapping.MODES:
            rows = [r for r in summary if r["path"] == path_name and r["mode"] == mode]
            if not rows:
                continue
            xs = [r["page_size"] for r in rows]
            for axis, key, suffix in ((ax, "gbps", ": map+populate"), (ax_lat, "map_us_per_page", "")):
                axis.plot(
                    xs,
                    [r[key] for r in rows],
                    styles[mode],
                    marker="o",
                    color=colors[path_name],
                    label=f"{path_name}, {mode}{suffix}",
                )
    largest = fills[max(fills, key=int)]
    fill_lines = (
        ("fill_faulted_gbps", f"fill_ faulted memory, {threads} threads", "tab:green", ":"),
        ("1thread_fill_faulted_gbps", "fill_ faulted memory, 1 thread", "tab:olive", ":"),
        ("first_touch_anon_gbps", f"first touch anonymous, {threads} threads", "tab:red", "-."),
        ("1thread_first_touch_anon_gbps", "first touch anonymous, 1 thread", "tab:brown", "-."),
        ("1thread_first_touch_memfd_gbps", "first touch memfd, 1 thread", "tab:purple", "--"),
    )
    for key, label, color, style in fill_lines:
        ax.axhline(
            largest[key], color=color, linestyle=style, linewidth=1.2, label=f"{label} ({largest[key]:.1f} GB/s)"
        )
    ax.set_yscale("log")
    ax_lat.set_ylim(bottom=0)
    below = {"fontsize": 7, "loc": "upper center", "bbox_to_anchor": (0.5, -0.13), "ncol": 2}
    mapping.label_page_size_axes(
        summary,
        (
            (ax, "GB/s (bytes / (map + populate))", "physical allocation bandwidth", below),
            (ax_lat, "us per page (map call only)", "map latency per page", {"fontsize": 8}),
        ),
    )
    save_figure(fig, path, title)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default="4K,64K,256K,2M", help="comma-separated page sizes")
    parser.add_argument("--total", default="512M", help="bytes mapped per run for pages >= --small-below")
    parser.add_argument("--small-total", default="64M", help="bytes mapped per run for smaller pages")
    parser.add_argument("--small-below", default="64K", help="page sizes under this use --small-total")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each config (median reported)")
    parser.add_argument("--batch", type=int, default=60, help="pages per map/populate call (60 = 30 layers x K,V)")
    parser.add_argument("--paths", default="native,ctypes", help="call paths: native and/or ctypes")
    parser.add_argument(
        "--fill-threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads for the fill bandwidth (default: torch's)",
    )
    parser.add_argument(
        "--prewarm-mib",
        type=int,
        default=1024,
        help="touch and free this much memory first, so 'fresh' is not the VM's first touch (0: off)",
    )
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--name", default="allocation", help="file name stem of the results")
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes (options given still win): {QUICK}")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    page_sizes = [parse_size(p) for p in args.page_sizes.split(",")]
    paths = [p.strip() for p in args.paths.split(",")]
    if "native" in paths and not native_available():
        raise SystemExit("native library missing: run `make native` (or pass --paths ctypes)")
    small_below = parse_size(args.small_below)
    totals = {ps: parse_size(args.small_total if ps < small_below else args.total) for ps in page_sizes}
    pages = {ps: pages_for_run(ps, totals[ps]) for ps in page_sizes}
    for ps in page_sizes:
        if pages[ps] * ps < totals[ps]:
            print(f"note: {size_label(ps)} pages cut to {pages[ps]} ({pages[ps] * ps // MiB} MiB) by vm.max_map_count")

    meta = {"command": command_line(), **machine_facts()}
    meta["prewarm"] = prewarm_memory(args.prewarm_mib * MiB)
    cpu_map = CpuShare()
    raw = mapping.repeated_runs(
        args.reps,
        page_sizes,
        paths,
        lambda ps, path: one_run(ps, pages[ps], native=(path == "native"), batch=args.batch),
        desc="allocation",
    )
    meta["cpu_during_mapping"] = cpu_map.stop()
    cpu_fill = CpuShare()
    fills = fill_bandwidths(sorted({pages[ps] * ps for ps in page_sizes}), args.reps, args.fill_threads)
    meta["cpu_during_fill"] = cpu_fill.stop()
    summary = summarize(raw)
    fill_rows = [
        {"page_label": "fill", "bytes": int(nbytes), "mode": key, "path": "torch", "gbps": value}
        for nbytes, values in fills.items()
        for key, value in values.items()
    ]
    csv_path, json_path, png_path = write_results(
        args.out,
        args.name,
        summary + fill_rows,
        {
            "meta": meta,
            "config": {
                "page_sizes": page_sizes,
                "pages": {str(k): v for k, v in pages.items()},
                "reps": args.reps,
                "batch": args.batch,
                "paths": paths,
                "fill_threads": args.fill_threads,
                "layout": "page i mapped at slot pages-1-i (no VMA merging); recycled at other addresses",
            },
            "summary": summary,
            "fill": fills,
            "raw": raw,
        },
    )
    title = f"{meta['command']}  |  {meta['cpu_model']}, {meta['nproc']} cores, {meta['date']}"
    plot(summary, fills, args.fill_threads, png_path, title)
    print_summary(summary, fills, meta)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


def fill_bandwidths(sizes: list[int], reps: int, threads: int) -> dict[str, dict[str, float]]:
    """torch's fill bandwidth over each size, with `threads` threads and with one."""
    fills: dict[str, dict[str, float]] = {}
    for nbytes in tqdm(sizes, desc="fill bandwidth", unit="size"):
        fills[str(nbytes)] = {
            **fill_bandwidth(nbytes, reps, threads),
            **{f"1thread_{k}": v for k, v in fill_bandwidth(nbytes, reps, 1).items()},
        }
    return fills


def print_summary(summary: list[dict[str, Any]], fills: dict[str, dict[str, float]], meta: dict[str, Any]) -> None:
    columns = (
        *mapping.run_columns(7),
        ("MiB", "mib", 5, ""),
        ("GB/s", "gbps", 7, ".2f"),
        ("map GB/s", "map_only_gbps", 9, ".1f"),
        ("pop GB/s", "populate_gbps", 9, ".2f"),
        *mapping.per_page_columns(".2f", {"map": "map", "pop": "populate", "unmap": "unmap"}),
    )
    print_table([{**r, "mib": r["bytes"] // MiB} for r in summary], columns)
    for nbytes, values in fills.items():
        print(f"fill {int(nbytes) // MiB} MiB: " + ", ".join(f"{k}={v:.2f} GB/s" for k, v in values.items()))
    if meta["prewarm"]["bytes"]:
        print(
            f"prewarm: {meta['prewarm']['bytes'] // MiB} MiB first touch at {meta['prewarm']['median_chunk_gbps']:.2f} "
            f"GB/s median, {meta['prewarm']['min_chunk_gbps']:.2f} slowest chunk"
        )
    print(
        f"CPU share taken by other processes: {meta['cpu_during_mapping']['other_share']:.0%} while mapping, "
        f"{meta['cpu_during_fill']['other_share']:.0%} while filling"
    )


if __name__ == "__main__":
    main()

"""Physical mapping bandwidth of the host backend (the paper's Table 7, on Linux).

For each page size and each call path (the C batch call, "native", or one ctypes call
per page), a new `HostBackend` (a new memfd, so its pages were never touched) maps and
populates `total` bytes: that is "fresh" allocation. The same pool pages are then
unmapped and mapped + populated again at other addresses: "recycled". Pages are mapped
in reversed pool order, so no two neighbouring mappings merge, as in the KV cache where
consecutive pool pages go to different tensors. GB/s = bytes / (map + populate seconds).

The same run measures what the machine can fill: `fill_` over already-faulted memory
and first-touch fills of fresh anonymous and fresh memfd mappings.

    python -m benchmarks.map_bandwidth [--reps 7] [--page-sizes 4K,64K,256K,2M]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from benchmarks._common import (
    RESULTS_DIR,
    CpuShare,
    command_line,
    machine_facts,
    prewarm_memory,
    save_figure,
    write_csv,
    write_json,
)
from vattn.backends.host import MAP_COUNT_HEADROOM, HostBackend, current_map_count, max_map_count
from vattn.backends.page_calls import native_available

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MODES = ("fresh", "recycled")


def parse_size(text: str) -> int:
    """'4K', '64k', '2M', '4096' -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": KiB, "M": MiB, "G": GiB}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def size_label(nbytes: int) -> str:
    for unit, scale in (("M", MiB), ("K", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def pages_for_run(page_size: int, total: int) -> int:
    """Pages of one run: `total` bytes, cut to what vm.max_map_count allows the backend."""
    pages = max(1, total // page_size)
    allowed = (max_map_count() - current_map_count() - MAP_COUNT_HEADROOM - 1) // 2 - 64
    return min(pages, allowed)


def batched(items: Sequence[int], size: int) -> list[Sequence[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def timed_batches(call: Callable[[Sequence[int]], Any], batches: list[Sequence[int]]) -> float:
    """Seconds to run `call` over every batch."""
    started = time.perf_counter()
    for batch in batches:
        call(batch)
    return time.perf_counter() - started


def one_run(page_size: int, pages: int, native: bool, batch: int) -> list[dict[str, Any]]:
    """Fresh then recycled map + populate of `pages` pages on a new backend; one row per mode."""
    backend = HostBackend(page_size, pages, reservations=1, native=native)
    nbytes = pages * page_size
    base = backend.reserve(2 * nbytes)  # room to map the recycled pages at other addresses
    rows: list[dict[str, Any]] = []
    try:
        pool = backend.create_pages(pages)
        # Page i at slot pages-1-i: reversed offsets, so neighbouring mappings never merge.
        fresh_addrs = [base + (pages - 1 - i) * page_size for i in range(pages)]
        recycled_addrs = [base + nbytes + (pages - 1 - i) * page_size for i in range(pages)]
        unmap_s = 0.0
        for mode, addrs in (("fresh", fresh_addrs), ("recycled", recycled_addrs)):
            addr_batches = batched(addrs, batch)
            pairs = list(zip(addr_batches, batched(pool, batch), strict=True))
            started = time.perf_counter()
            for addr_batch, page_batch in pairs:
                backend.map(addr_batch, page_batch)
            map_s = time.perf_counter() - started
            done = 0

            def populate(addr_batch: Sequence[int]) -> None:
                nonlocal done
                done += backend.populate(addr_batch)

            populate_s = timed_batches(populate, addr_batches)
            if done != pages:
                raise RuntimeError(f"populate did {done} of {pages} pages")
            if mode == "fresh":
                unmap_s = timed_batches(backend.unmap, addr_batches)
            rows.append(
                {
                    "page_size": page_size,
                    "page_label": size_label(page_size),
                    "path": backend.calls.name,
                    "mode": mode,
                    "pages": pages,
                    "bytes": nbytes,
                    "batch": batch,
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
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for row in raw:
        groups.setdefault((row["page_size"], row["path"], row["mode"]), []).append(row)
    summary = []
    for (page_size, path, mode), rows in sorted(groups.items()):
        med = {key: statistics.median(r[key] for r in rows) for key in ("map_s", "populate_s", "total_s")}
        out: dict[str, Any] = {
            "page_size": page_size,
            "page_label": size_label(page_size),
            "path": path,
            "mode": mode,
            "pages": rows[0]["pages"],
            "bytes": rows[0]["bytes"],
            "reps": len(rows),
            **{f"median_{key}": value for key, value in med.items()},
            "gbps": rows[0]["bytes"] / med["total_s"] / 1e9,
            "gbps_min": min(r["gbps"] for r in rows),
            "gbps_max": max(r["gbps"] for r in rows),
            "map_only_gbps": rows[0]["bytes"] / med["map_s"] / 1e9,
            "populate_gbps": rows[0]["bytes"] / med["populate_s"] / 1e9,
            "map_us_per_page": statistics.median(r["map_us_per_page"] for r in rows),
            "populate_us_per_page": statistics.median(r["populate_us_per_page"] for r in rows),
        }
        unmap = [r["unmap_us_per_page"] for r in rows if r["unmap_us_per_page"] is not None]
        out["unmap_us_per_page"] = statistics.median(unmap) if unmap else None
        summary.append(out)
    return summary


def plot(
    summary: list[dict[str, Any]], fills: dict[str, dict[str, float]], threads: int, path: Path, title: str
) -> None:
    """GB/s vs page size per path x mode with fill bandwidths (largest size), and map latency per page.

    Populate runs in one thread, so the 1-thread first-touch line is its natural ceiling.
    """
    fig, (ax, ax_lat) = plt.subplots(1, 2, figsize=(13, 6.4), gridspec_kw={"width_ratios": [3, 2]})
    page_sizes = sorted({row["page_size"] for row in summary})
    styles = {"fresh": "-", "recycled": "--"}
    colors = {"native": "tab:blue", "ctypes": "tab:orange"}
    for path_name in ("native", "ctypes"):
        for mode in MODES:
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
    for axis in (ax, ax_lat):
        axis.set_xscale("log", base=2)
        axis.set_xticks(page_sizes, [size_label(p) for p in page_sizes])
        axis.set_xlabel("page size")
        axis.grid(True, which="both", alpha=0.3)
    ax.set_ylabel("GB/s (bytes / (map + populate))")
    ax.set_title("physical allocation bandwidth")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax_lat.set_ylabel("us per page (map call only)")
    ax_lat.set_title("map latency per page")
    ax_lat.legend(fontsize=8)
    save_figure(fig, path, title)


def main(argv: Sequence[str] | None = None) -> None:
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
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument("--name", default="map_bandwidth", help="file name stem of the results")
    args = parser.parse_args(argv)

    page_sizes = [parse_size(p) for p in args.page_sizes.split(",")]
    paths = [p.strip() for p in args.paths.split(",")]
    if "native" in paths and not native_available():
        raise SystemExit("native library missing: run `make native` (or pass --paths ctypes)")
    small_below = parse_size(args.small_below)
    totals = {ps: parse_size(args.small_total if ps < small_below else args.total) for ps in page_sizes}
    pages = {ps: pages_for_run(ps, totals[ps]) for ps in page_sizes}
    for ps in page_sizes:
        if pages[ps] * ps < totals[ps]:
            print(f"note: {size_label(ps)} pages cut to {pages[ps]} ({pages[ps] * ps >> 20} MiB) by vm.max_map_count")

    meta = {"command": command_line(), **machine_facts()}
    meta["prewarm"] = prewarm_memory(args.prewarm_mib << 20)
    raw: list[dict[str, Any]] = []
    cpu_map = CpuShare()
    jobs = [(rep, ps, path) for rep in range(args.reps) for ps in page_sizes for path in paths]
    for rep, ps, path in tqdm(jobs, desc="map bandwidth", unit="run"):
        for row in one_run(ps, pages[ps], native=(path == "native"), batch=args.batch):
            raw.append({"rep": rep, **row})

    meta["cpu_during_mapping"] = cpu_map.stop()
    fills: dict[str, dict[str, float]] = {}
    cpu_fill = CpuShare()
    for nbytes in tqdm(sorted({pages[ps] * ps for ps in page_sizes}), desc="fill bandwidth", unit="size"):
        fills[str(nbytes)] = {
            **fill_bandwidth(nbytes, args.reps, args.fill_threads),
            **{f"1thread_{k}": v for k, v in fill_bandwidth(nbytes, args.reps, 1).items()},
        }

    meta["cpu_during_fill"] = cpu_fill.stop()
    summary = summarize(raw)
    fill_rows = [
        {"page_label": "fill", "bytes": int(nbytes), "mode": key, "path": "torch", "gbps": value}
        for nbytes, values in fills.items()
        for key, value in values.items()
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = (args.out / f"{args.name}.{ext}" for ext in ("csv", "json", "png"))
    write_csv(csv_path, summary + fill_rows)
    write_json(
        json_path,
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

    print(
        f"\n{'page':>5} {'path':>7} {'mode':>9} {'MiB':>5} {'GB/s':>7} {'map GB/s':>9} {'pop GB/s':>9} "
        f"{'map us/pg':>10} {'pop us/pg':>10} {'unmap us/pg':>12}"
    )
    for r in summary:
        unmap = f"{r['unmap_us_per_page']:12.2f}" if r["unmap_us_per_page"] is not None else f"{'':>12}"
        print(
            f"{r['page_label']:>5} {r['path']:>7} {r['mode']:>9} {r['bytes'] >> 20:>5} {r['gbps']:7.2f} "
            f"{r['map_only_gbps']:9.1f} {r['populate_gbps']:9.2f} {r['map_us_per_page']:10.2f} "
            f"{r['populate_us_per_page']:10.2f}{unmap}"
        )
    for nbytes, values in fills.items():
        print(f"fill {int(nbytes) >> 20} MiB: " + ", ".join(f"{k}={v:.2f} GB/s" for k, v in values.items()))
    if meta["prewarm"]["bytes"]:
        print(
            f"prewarm: {meta['prewarm']['bytes'] >> 20} MiB first touch at {meta['prewarm']['median_chunk_gbps']:.2f} "
            f"GB/s median, {meta['prewarm']['min_chunk_gbps']:.2f} slowest chunk"
        )
    print(
        f"CPU share taken by other processes: {meta['cpu_during_mapping']['other_share']:.0%} while mapping, "
        f"{meta['cpu_during_fill']['other_share']:.0%} while filling"
    )
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()

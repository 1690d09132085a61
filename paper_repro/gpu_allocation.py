"""Table 7 on a GPU, allocation bandwidth: physical mapping bandwidth of the CUDA backend.

For each page size (a multiple of the 2 MiB CUDA granularity) and each call path, a new
`CudaBackend` works through `--total` bytes of device memory in pages:

- "fresh": cuMemCreate every page (`create_s`, one cuda-python call per page on both
  paths: the backend has no batched create), then cuMemMap + cuMemSetAccess them into a
  reservation (`map_s`), `--batch` pages per `backend.map()` call.
  GB/s = bytes / (create_s + map_s); `map_only_gbps` = bytes / map_s.
- "recycled": the same pages unmapped, then mapped again at other addresses of the
  reservation (what the KV cache does with a page a finished request gave back).
  GB/s = bytes / map_s.

Call paths: "native" (one call per batch into libvattn_native, which calls libcuda with
the GIL released) and "cuda-python" (cuMemMap and cuMemSetAccess through the Python
bindings, per page). Unmap and release times per page are recorded too. After each run
the recycled mapping is written through a torch view and read back (not timed), so a
mapping that does not work fails loudly. Median of `--reps` runs.

    python -m paper_repro.gpu_allocation [--quick] [--page-sizes 2M,4M,8M,16M,32M] [--total 4G] [--reps 5]

`--quick` maps 64 MiB of 2M and 4M pages once each. Results go to
`paper_repro/results/<device>/gpu_allocation.*`; the host version is paper_repro.allocation.

Without a CUDA GPU and cuda-python it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import torch

from measure.gpu import cannot_run, exit_unless_cuda, gpu_facts
from measure.results import command_line, machine_facts, print_table, save_figure, write_results
from paper_repro import _mapping as mapping
from paper_repro._harness import results_dir
from vattn.errors import UnavailableError
from vattn.sizes import MiB, parse_size, size_label

if TYPE_CHECKING:
    from vattn.backends.cuda import CudaBackend

PATHS = ("native", "cuda-python")
FREE_SHARE = 0.8
"""At most this share of the GPU's free memory is mapped in one run."""
QUICK = {"page_sizes": "2M,4M", "total": "64M", "reps": 1}
"""The defaults `--quick` sets."""


def cuda_backend(page_size: int, pages: int, path: str) -> CudaBackend:
    from vattn.backends.cuda import CudaBackend

    backend = CudaBackend(page_size, pages, native=(path == "native"))
    if backend.calls.name != path:
        backend.close()
        raise RuntimeError(f"asked for the {path} call path, the backend chose {backend.calls.name}")
    return backend


def probe_paths(paths: Sequence[str]) -> tuple[dict[str, str], int]:
    """Why each call path that cannot be measured here cannot (the native library not built, ...),
    and the CUDA allocation granularity (page sizes must be multiples of it; 2 MiB on current GPUs)."""
    skipped: dict[str, str] = {}
    granularity = 2 * MiB
    for path in paths:
        try:
            probe = cuda_backend(2 * MiB, 1, path)  # creates no page
        except (UnavailableError, RuntimeError) as exc:
            skipped[path] = str(exc)
            continue
        granularity = probe.granularity
        probe.close()
    return skipped, granularity


def verify_mapping(backend: CudaBackend, view: torch.Tensor, offset: int, pages: int) -> None:
    """Writes one byte per page of `view[offset:]` through the GPU and reads them back."""
    page_size = backend.page_size
    marks = torch.arange(pages, device=backend.device, dtype=torch.int64).remainder(251).add(1).to(torch.uint8)
    where = slice(offset, offset + pages * page_size, page_size)
    view[where] = marks
    torch.cuda.synchronize(backend.device)
    if not torch.equal(view[where], marks):
        raise RuntimeError(f"{size_label(page_size)} pages via {backend.calls.name}: read back differs from written")


def one_run(page_size: int, pages: int, path: str, batch: int, verify: bool) -> list[dict[str, Any]]:
    """Fresh then recycled mapping of `pages` pages on a new backend; one row per mode."""
    backend = cuda_backend(page_size, pages, path)
    nbytes = pages * page_size
    base = backend.reserve(2 * nbytes)  # room to map the recycled pages at other addresses
    view = backend.tensor(base, 2 * nbytes) if verify else None  # made while nothing is mapped there
    pool: list[int] = []
    mapped: list[int] = []
    rows: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        pool = backend.create_pages(pages)
        create_s = time.perf_counter() - started
        fresh_addrs = [base + i * page_size for i in range(pages)]
        recycled_addrs = [base + nbytes + i * page_size for i in range(pages)]
        for mode, addrs in (("fresh", fresh_addrs), ("recycled", recycled_addrs)):
            pairs = list(zip(mapping.batched(addrs, batch), mapping.batched(pool, batch), strict=True))
            started = time.perf_counter()
            for addr_batch, page_batch in pairs:
                backend.map(addr_batch, page_batch)
                mapped += addr_batch
            map_s = time.perf_counter() - started
            if view is not None and mode == "recycled":
                verify_mapping(backend, view, nbytes, pages)
            unmap_s = mapping.timed_batches(backend.unmap, mapping.batched(addrs, batch))
            mapped = []
            total_s = create_s + map_s if mode == "fresh" else map_s
            rows.append(
                {
                    **mapping.run_fields(page_size, backend.calls.name, mode, pages, batch),
                    "create_s": create_s if mode == "fresh" else 0.0,
                    "map_s": map_s,
                    "total_s": total_s,
                    "gbps": nbytes / total_s / 1e9,
                    "map_only_gbps": nbytes / map_s / 1e9,
                    "create_us_per_page": create_s / pages * 1e6 if mode == "fresh" else None,
                    "map_us_per_page": map_s / pages * 1e6,
                    "unmap_us_per_page": unmap_s / pages * 1e6,
                }
            )
        started = time.perf_counter()
        backend.release_pages(pool)
        release_s = time.perf_counter() - started
        pool = []
        for row in rows:
            row["release_us_per_page"] = release_s / pages * 1e6
    finally:
        view = None
        # Left over only when something failed: clean up without hiding that error.
        with contextlib.suppress(Exception):
            if mapped:
                backend.unmap(mapped)
        with contextlib.suppress(Exception):
            if pool:
                backend.release_pages(pool)
        backend.free_reservation(base, 2 * nbytes)
        backend.close()
    return rows


def summarize(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median of every timing over the repetitions of each (page size, path, mode)."""
    return mapping.summarize_runs(
        raw,
        ("create_s", "map_s", "total_s"),
        ("create_us_per_page", "map_us_per_page", "unmap_us_per_page", "release_us_per_page"),
    )


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    """GB/s vs page size per call path x mode, and the per-page cost of each driver call."""
    fig, ax, ax_lat = mapping.page_size_figure(5.5)
    colors = {"native": "tab:blue", "cuda-python": "tab:orange"}
    for path_name in PATHS:
        fresh = [r for r in summary if r["path"] == path_name and r["mode"] == "fresh"]
        recycled = [r for r in summary if r["path"] == path_name and r["mode"] == "recycled"]
        if not fresh:
            continue
        color = colors[path_name]
        xs = [r["page_size"] for r in fresh]
        ax.plot(xs, [r["gbps"] for r in fresh], "-", marker="o", color=color, label=f"{path_name}, fresh (create+map)")
        ax.plot(
            [r["page_size"] for r in recycled],
            [r["gbps"] for r in recycled],
            "--",
            marker="s",
            color=color,
            label=f"{path_name}, recycled (map)",
        )
        for key, style, label in (
            ("map_us_per_page", "-", "map"),
            ("create_us_per_page", ":", "cuMemCreate"),
            ("unmap_us_per_page", "-.", "unmap"),
        ):
            ax_lat.plot(xs, [r[key] for r in fresh], style, marker=".", color=color, label=f"{path_name}: {label}")
    ax.set_yscale("log")
    ax_lat.set_yscale("log")
    mapping.label_page_size_axes(
        summary,
        (
            (ax, "GB/s", "physical allocation bandwidth (CUDA VMM)", {"fontsize": 8}),
            (ax_lat, "us per page (fresh run)", "driver call cost per page", {"fontsize": 7}),
        ),
    )
    save_figure(fig, path, title)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default="2M,4M,8M,16M,32M", help="comma-separated, multiples of 2M")
    parser.add_argument(
        "--total", default="4G", help=f"bytes mapped per run (capped to {FREE_SHARE} x the free GPU memory)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each config (median reported)")
    parser.add_argument("--batch", type=int, default=64, help="pages per map/unmap call (64 = 32 layers x K,V)")
    parser.add_argument("--paths", default=",".join(PATHS), help="call paths: native and/or cuda-python")
    parser.add_argument("--no-verify", action="store_true", help="skip the write/read-back check after each run")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--name", default="gpu_allocation", help="file name stem of the results")
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes (options given still win): {QUICK}")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    args.page_sizes = [parse_size(p) for p in args.page_sizes.split(",")]
    args.paths = [p.strip() for p in args.paths.split(",")]
    if unknown := set(args.paths) - set(PATHS):
        raise SystemExit(f"unknown paths {sorted(unknown)}; choose from {list(PATHS)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    page_sizes = args.page_sizes
    exit_unless_cuda()

    skipped, granularity = probe_paths(args.paths)
    if wrong := [size_label(ps) for ps in page_sizes if ps % granularity]:
        raise SystemExit(f"page sizes {wrong} are not multiples of the CUDA granularity {size_label(granularity)}")
    for path, reason in skipped.items():
        print(f"skipping the {path} path: {reason}")
    paths = [p for p in args.paths if p not in skipped]
    if not paths:
        cannot_run("no call path is available")

    total = bytes_per_run(parse_size(args.total))
    pages = {ps: total // ps for ps in page_sizes}
    if too_big := [size_label(ps) for ps, n in pages.items() if n == 0]:
        raise SystemExit(f"pages {too_big} are larger than the {total // MiB} MiB a run may map")

    meta = {"command": command_line(), **machine_facts(), "gpu": gpu_facts()}
    for path in paths:  # warm-up, not recorded: driver and library first-call costs
        one_run(page_sizes[0], min(pages[page_sizes[0]], 2 * args.batch), path, args.batch, verify=False)
    raw = mapping.repeated_runs(
        args.reps,
        page_sizes,
        paths,
        lambda ps, path: one_run(ps, pages[ps], path, args.batch, verify=not args.no_verify),
        desc="gpu allocation",
    )

    summary = summarize(raw)
    csv_path, json_path, png_path = write_results(
        args.out,
        args.name,
        summary,
        {
            "meta": meta,
            "config": {
                "page_sizes": page_sizes,
                "pages": {str(k): v for k, v in pages.items()},
                "total_bytes": total,
                "reps": args.reps,
                "batch": args.batch,
                "paths": paths,
                "skipped_paths": skipped,
                "verified": not args.no_verify,
                "layout": "page i at base + i * page_size; recycled at base + total + i * page_size",
            },
            "summary": summary,
            "raw": raw,
        },
    )
    gpu = meta["gpu"]
    title = f"{meta['command']}  |  {gpu['device_name']}, driver CUDA {gpu['driver_cuda_version']}, {meta['date']}"
    plot(summary, png_path, title)
    print_summary(summary, f"{gpu['device_name']}: {total // MiB} MiB per run, median of {args.reps}")
    print(f"wrote {csv_path}, {json_path}, {png_path}")


def bytes_per_run(asked: int) -> int:
    """`--total`, cut to FREE_SHARE of the GPU's free memory."""
    free, _ = torch.cuda.mem_get_info()
    total = min(asked, int(free * FREE_SHARE))
    if total < asked:
        print(f"note: --total cut to {total // MiB} MiB ({FREE_SHARE:.0%} of the {free // MiB} MiB free)")
    return total


def print_summary(summary: list[dict[str, Any]], caption: str) -> None:
    columns = (
        *mapping.run_columns(12),
        ("GB/s", "gbps", 8, ".1f"),
        ("map GB/s", "map_only_gbps", 9, ".1f"),
        *mapping.per_page_columns(".1f", {call: call for call in ("create", "map", "unmap", "release")}),
    )
    print_table(summary, columns, caption)


if __name__ == "__main__":
    main()

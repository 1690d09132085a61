"""Probes one GPU attention kernel: built and run once on a small cache in bfloat16 and float16.

    python -m benchmarks.gpu_probe KERNEL [--out kernels.jsonl]

KERNEL is any of vattn.kernels.KERNELS (the virtual cache) or vattn.paged.PAGED_KERNELS (the
paged baseline) that runs on a GPU. Each dtype gets one line of JSON: `available` with the
seconds its construction took (FlashInfer compiles or loads its kernels there) and its first
call (a decode and a prefill chunk together), `unavailable` with the reason (the library or
the torch entry point is not here: `UnavailableError`), or `failed` with the error (anything
else, a fault in a kernel that built included). benchmarks/gpu_suite.sh runs each kernel in a
process of its own, so a fault that poisons the CUDA context costs only that kernel's line;
tests/test_cuda.py then checks the values of every available kernel against float64.
Exit status: 1 when a dtype failed, else 0.

    python -m benchmarks.gpu_probe --plan [--out kernels.jsonl]

writes the `unavailable` lines of the kernels whose library is not installed (flash-attn,
FlashInfer: nothing to build, no process of their own needed) and prints the names of the rest,
the ones to probe.

    python -m benchmarks.gpu_probe --untested kernels.jsonl cuda_tests.xml

lists each kernel and dtype the probe found available whose tests in tests/test_cuda.py (the
JUnit XML of that run) all skipped, or that has none: a GPU run that tests nothing it has is a
failure (exit status 1), not a pass.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import torch

from vattn import KVCache, KVCacheConfig, UnavailableError
from vattn.kernels import KERNELS, make_kernel
from vattn.paged import PAGED_KERNELS, PagedKVCache, PagedKVCacheConfig, make_paged_kernel

GPU_KERNELS = {
    name: cache
    for cache, names in (("virtual", KERNELS), ("paged", PAGED_KERNELS))
    for name in names
    if "flash" in name
}
"""The kernels that need a GPU library (torch's FlashAttention counts): the CPU ones and
torch SDPA are exercised by the tests wherever they run."""
DTYPES = ("bfloat16", "float16")
SHAPE = (8, 128, 32)
"""KV heads, head size, query heads: the paper's Llama-3-8B."""
NEW_TOKENS = (1, 37, 1)
LENGTHS = (300, 37, 5)


def build(name: str, dtype: str) -> tuple[Any, list[int], float]:
    """The kernel on a one-layer cache of its kind on the GPU, the cache's requests (at
    `LENGTHS`) and the seconds the kernel took to make."""
    kv_heads, head_dim, query_heads = SHAPE
    if GPU_KERNELS[name] == "virtual":
        cache: KVCache | PagedKVCache = KVCache(
            KVCacheConfig(1, kv_heads, head_dim, 4, 4096, dtype=dtype, backend="cuda", background=False)
        )
    else:
        block_size = 256 if "flash_attn" in name else 16  # FlashAttention 2's paged path: multiples of 256
        cache = PagedKVCache(
            PagedKVCacheConfig(1, kv_heads, head_dim, 4, 4096, dtype=dtype, block_size=block_size, device="cuda")
        )
    reqids = [cache.alloc_reqid() for _ in LENGTHS]
    cache.step(dict(zip(reqids, LENGTHS, strict=True)))
    started = time.perf_counter()
    make = make_kernel if GPU_KERNELS[name] == "virtual" else make_paged_kernel
    kernel = make(name, cache, query_heads)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    return kernel, reqids, time.perf_counter() - started


def reason(exc: BaseException) -> str:
    """The exception's type and first line (the traceback is printed in full)."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def probe(name: str, dtype: str) -> dict[str, Any]:
    kv_heads, head_dim, query_heads = SHAPE
    line: dict[str, Any] = {"kernel": name, "cache": GPU_KERNELS[name], "dtype": dtype}
    try:
        kernel, reqids, build_seconds = build(name, dtype)
    except UnavailableError as exc:
        return line | {"status": "unavailable", "reason": str(exc)}
    except Exception as exc:
        traceback.print_exc()
        return line | {"status": "failed", "reason": f"building: {reason(exc)}"}
    try:
        started = time.perf_counter()
        batch = kernel.plan(reqids, NEW_TOKENS)
        tokens, device, torch_dtype = sum(NEW_TOKENS), torch.device("cuda"), getattr(torch, dtype)
        q, k, v = (
            torch.randn(tokens, heads, head_dim).to(device, torch_dtype) for heads in (query_heads, kv_heads, kv_heads)
        )
        out = kernel.forward(0, batch, q, k, v)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - started
        assert tuple(out.shape) == (tokens, query_heads, head_dim), out.shape
    except Exception as exc:
        traceback.print_exc()
        return line | {"status": "failed", "build_s": build_seconds, "reason": f"running: {reason(exc)}"}
    return line | {"status": "available", "build_s": round(build_seconds, 3), "first_call_s": round(first_call, 3)}


def library(name: str) -> str | None:
    """The Python package the kernel needs beyond torch, if any."""
    if "flashinfer" in name:
        return "flashinfer"
    return "flash_attn" if name.removeprefix("paged_") == "flash_attn" else None


def plan() -> tuple[list[str], list[dict[str, Any]]]:
    """The kernels to probe, and the lines of those whose package is not installed."""
    needs = {name: library(name) for name in GPU_KERNELS}
    absent = {name: package for name, package in needs.items() if package and not importlib.util.find_spec(package)}
    lines = [
        {
            "kernel": name,
            "cache": GPU_KERNELS[name],
            "dtype": dtype,
            "status": "unavailable",
            "reason": f"the {name} kernel needs {package}, which is not installed",
        }
        for name, package in absent.items()
        for dtype in DTYPES
    ]
    return [name for name in GPU_KERNELS if name not in absent], lines


def write(lines: list[dict[str, Any]], out: Path | None) -> None:
    """Each line as JSON on stdout, and appended to `out` too."""
    for line in lines:
        text = json.dumps(line)
        print(text)
        if out:
            with out.open("a") as file:
                file.write(text + "\n")


def untested(probes: list[dict[str, Any]], junit: ElementTree.Element) -> list[str]:
    """`kernel dtype` of each available probe whose test cases (by their parameters, e.g.
    `test_kernels_match_reference[bfloat16-mega-torch_flash_attn]`) are all skipped or absent."""
    ran: dict[tuple[str, str], bool] = {}
    for case in junit.iter("testcase"):
        name = case.get("name", "")
        if "[" not in name:
            continue
        parameters = set(name[name.index("[") + 1 : -1].split("-"))
        for probe in probes:
            key = (probe["kernel"], probe["dtype"])
            if set(key) <= parameters:
                ran[key] = ran.get(key, False) or case.find("skipped") is None
    return [
        f"{p['kernel']} {p['dtype']}"
        for p in probes
        if p["status"] == "available" and not ran.get((p["kernel"], p["dtype"]), False)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", nargs="?", choices=sorted(GPU_KERNELS))
    parser.add_argument("--out", type=Path, help="appends the lines here too")
    parser.add_argument("--plan", action="store_true", help="the kernels to probe (see above)")
    parser.add_argument("--untested", nargs=2, type=Path, metavar=("PROBES", "JUNIT_XML"))
    args = parser.parse_args(argv)
    if args.untested:
        probes = [json.loads(line) for line in args.untested[0].read_text().splitlines() if line.strip()]
        missing = untested(probes, ElementTree.parse(args.untested[1]).getroot())
        for line in missing:
            print(f"available but untested (its tests skipped): {line}")
        sys.exit(1 if missing else 0)
    if args.plan:
        to_probe, absent = plan()
        with contextlib.redirect_stdout(sys.stderr):
            write(absent, args.out)
        print(*to_probe)
        return
    if args.kernel is None:
        parser.error("name a kernel, --plan or --untested")
    lines = [probe(args.kernel, dtype) for dtype in DTYPES]
    write(lines, args.out)
    sys.exit(1 if any(line["status"] == "failed" for line in lines) else 0)


if __name__ == "__main__":
    main()

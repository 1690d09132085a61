"""vattn's HTTP server against its peers: vLLM's CPU build, llama.cpp's server, `transformers serve`.

Every system is started on a free loopback port and waited on until /health answers, then warmed
up with as many requests at once as the deepest level holds, so that a peer that compiles graphs
per batch shape (vLLM) has compiled them before anything is timed. Then `--rounds` rounds: in
each, every level runs on every system in turn, so the systems alternate and a slow spell of the
machine falls on all of them. While one system runs a level the others are paused (SIGSTOP): idle,
vLLM's server still took 2-3% of the CPU during vattn's levels, where the measured server computes
on both of the machine's two cores. A level is driven by the streaming client of
benchmarks.serving_load: a fixed number of requests in flight, seeded prompts of 32-512 words (one
token each), fresh for every level of every round but the same for every system, greedy, 64 output
tokens with EOS ignored, on /v1/completions (every peer has it). vattn and vLLM get the same KV
space (measure.peers.KV_SPACE_GIB).

Reported per system, level and round: output tokens/s, TTFT and TPOT p50/p99, and the peak RSS of
the server's whole process tree (its session, polled from /proc; pages shared between processes
count once per process). Systems compare within a precision class (`precision`): each vattn
system against each peer of its class, level by level, as the ratio of their tokens/s round by
round, its median and range. Peers live in their own venvs under .peers/ (`make peers`); one
that is missing is skipped, and the reason printed and recorded; each command line and version
goes in the JSON.

    python -m benchmarks.serving_compare [--concurrency 1,16,48] [--requests 48] [--rounds 3] [--quick]
        [--vattn "fp32=--dtype float32" --vattn "bf16=--dtype bfloat16"]
        [--systems vattn-fp32,vllm,vllm-bf16,llamacpp-f32]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import matplotlib
from matplotlib.ticker import ScalarFormatter
from tqdm import tqdm

from benchmarks.served_systems import (
    DEFAULT_VATTN,
    PEER_NAMES,
    System,
    hf_system,
    llamacpp_system,
    vattn_system,
    vllm_system,
)
from measure.peers import PEERS
from measure.results import (
    RESULTS_DIR,
    CpuShare,
    command_line,
    machine_facts,
    print_table,
    ratio_range,
    save_figure,
    write_results,
)
from measure.servers import TreeRss, pause_session, server_share, server_ticks, started
from measure.streams import Timing, http_client, one_request, summarize
from measure.workloads import random_word_prompts
from serving.default_model import DEFAULT_MODEL, cache_dir, default_model_dir
from serving.model.cpu_features import bf16_native

matplotlib.use("Agg")
import matplotlib.pyplot as plt


async def run_level(
    url: str, system: System, model: str, prompts: list[str], concurrency: int, output_tokens: int
) -> tuple[list[Timing], float]:
    """Sends every prompt, `concurrency` requests in flight at all times; returns timings and seconds."""
    client = http_client()
    pending = iter(prompts)  # shared by the workers: each takes the next prompt when it is free
    timings: list[Timing] = []
    bar = tqdm(total=len(prompts), desc=f"{system.name} c={concurrency}", unit="req")

    async def worker() -> None:
        for prompt in pending:
            timings.append(await one_request(client, url, model, prompt, output_tokens, system.extra_body))
            bar.update()

    begun = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        bar.close()
        await client.aclose()
    return timings, time.perf_counter() - begun


@dataclass
class Server:
    """A started system, warmed up, with its RSS poller."""

    system: System
    url: str
    process: subprocess.Popen[bytes]
    model: str
    rss: TreeRss


def start_server(
    system: System, warmups: list[str], args: argparse.Namespace, logs: Path, stack: ExitStack
) -> tuple[dict[str, Any], Server | None]:
    """Starts and warms up one system (`warmups` all at once) for the rest of `stack`; returns its
    description and the server, or None where it is skipped or failed to start."""
    info: dict[str, Any] = asdict(system) | {"command": shlex.join(system.command), "log": str(logs)}
    if system.skip:
        print(f"skipping {system.name}: {system.skip}")
        return info, None
    try:
        log = logs / f"{system.name}.log"
        url, process, seconds = stack.enter_context(
            started(system.name, system.command, log, args.startup_timeout, system.env)
        )
        info["startup_s"] = round(seconds, 1)
        model = system.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        info["model"] = model
        rss = TreeRss(process.pid)
        stack.callback(rss.stop)
        asyncio.run(run_level(url, system, model, warmups, len(warmups), args.output_tokens))
        info["idle_rss_mib"] = rss.take()
        return info, Server(system, url, process, model, rss)
    except Exception as error:  # one system failing must not lose the others' results
        info["error"] = f"{type(error).__name__}: {error}"
        print(f"{system.name} failed: {info['error']}")
        return info, None


def measure_level(
    server: Server, concurrency: int, prompts: list[str], round_number: int, output_tokens: int
) -> dict[str, Any]:
    """One level on one started system: its row."""
    pid = server.process.pid
    cpu, ticks, begun = CpuShare(), server_ticks(pid), time.monotonic()
    timings, elapsed = asyncio.run(
        run_level(server.url, server.system, server.model, prompts, concurrency, output_tokens)
    )
    share = server_share(pid, ticks, begun)
    return {
        "system": server.system.name,
        "precision": server.system.precision,
        "concurrency": concurrency,
        "round": round_number,
        **summarize(timings, elapsed),
        "short_requests": sum(t.tokens != output_tokens for t in timings),
        "peak_rss_mib": server.rss.take(),
        "server_cpu_share": round(share, 3),
        # the machine's CPU time that went to neither the server nor this client
        "other_cpu_share": round(max(0.0, cpu.stop()["other_share"] - share), 3),
    }


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per system and level: the median over rounds of each figure, tokens/s with its range."""
    keys = dict.fromkeys((row["system"], row["concurrency"]) for row in rows)
    found = []
    for system, concurrency in keys:
        mine = [row for row in rows if row["system"] == system and row["concurrency"] == concurrency]
        speeds = sorted(row["output_tokens_per_s"] for row in mine)
        row = {"system": system, "precision": mine[0]["precision"], "concurrency": concurrency, "rounds": len(mine)}
        for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "peak_rss_mib"):
            row[key] = statistics.median(r[key] for r in mine)
        found.append(row | {"output_tokens_per_s_min": speeds[0], "output_tokens_per_s_max": speeds[-1]})
    return found


def default_peers() -> set[str]:
    """The peers that run at their project's default on this CPU: vLLM's CPU build computes in
    bf16 where the CPU does bf16 natively (AVX512_BF16, AMX), in fp32 elsewhere."""
    return {"vllm-bf16" if bf16_native() else "vllm"}


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each vattn system against each peer of its precision class, and vattn's default against
    each peer's default (`defaults`), level by level: the ratio of their tokens/s round by round
    (the rounds both completed), its median and range."""
    speed = {(r["system"], r["concurrency"], r["round"]): r["output_tokens_per_s"] for r in rows}
    classes = {r["system"]: r["precision"] for r in rows}
    pairs = [
        (ours, peer)
        for ours, precision in classes.items()
        if ours.startswith("vattn")
        for peer, theirs in classes.items()
        if theirs == precision and not peer.startswith("vattn")
    ]
    # Each at its defaults: vattn's against the peer's own default on this CPU.
    pairs += [("vattn-default", peer) for peer in default_peers() if {"vattn-default", peer} <= classes.keys()]
    found = []
    for ours, peer in pairs:
        for concurrency in dict.fromkeys(r["concurrency"] for r in rows):
            rounds = [r for s, c, r in speed if s == ours and c == concurrency and (peer, c, r) in speed]
            if rounds:
                ratios = ratio_range(
                    [speed[ours, concurrency, r] for r in rounds], [speed[peer, concurrency, r] for r in rounds]
                )
                precision = classes[ours] if classes[ours] == classes[peer] else "defaults"
                found.append(
                    {"system": ours, "peer": peer, "precision": precision, "concurrency": concurrency}
                    | {"rounds": len(rounds)}
                    | ratios
                )
    return found


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name in dict.fromkeys(row["system"] for row in rows):
        mine = [row for row in rows if row["system"] == name]
        x = [row["concurrency"] for row in mine]
        (line,) = axes[0].plot(x, [row["output_tokens_per_s"] for row in mine], "o-", label=name)
        for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
            unit = "s" if key == "ttft" else "ms"
            ax.plot(x, [row[f"{key}_p50_{unit}"] for row in mine], "o-", color=line.get_color(), label=f"{name} p50")
            ax.plot(x, [row[f"{key}_p99_{unit}"] for row in mine], "x:", color=line.get_color(), label=f"{name} p99")
    for ax, label in zip(axes, ("output tokens/s", "TTFT (s)", "TPOT (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({row["concurrency"] for row in rows}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6, ncol=2)
    save_figure(fig, path, title)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[System]]:
    """The options and the systems they choose, in the order they are measured."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vattn",
        action="append",
        metavar="NAME=ARGS",
        help="a vattn configuration: extra `vattn serve` arguments (repeatable; default: "
        + " and ".join(DEFAULT_VATTN)
        + "); its NAME gives its precision class (fp32, bf16, bf16w, int8, q8, w8)",
    )
    parser.add_argument("--systems", help=f"comma-separated subset of vattn, vattn-NAME, {', '.join(PEER_NAMES)}")
    parser.add_argument("--concurrency", default="1,16,48", help="requests in flight, one level each")
    parser.add_argument("--requests", type=int, default=48, help="requests per level")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every level on every system")
    parser.add_argument("--quick", action="store_true", help="concurrency 1,16 with 16 requests, to try things")
    parser.add_argument("--shortest", type=int, default=32, help="shortest prompt, words (one token each)")
    parser.add_argument("--longest", type=int, default=512, help="longest prompt, words")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=1200, help="seconds (vLLM takes ~7 minutes)")
    parser.add_argument("--model-dir", type=Path, default=default_model_dir(), help="the safetensors folder")
    parser.add_argument("--q4-gguf", type=Path, default=cache_dir() / "downloads" / f"{DEFAULT_MODEL}.Q4_1.gguf")
    parser.add_argument("--f32-gguf", type=Path, default=PEERS / "llamacpp" / f"{DEFAULT_MODEL}.F32.gguf")
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=PEERS / "llamacpp" / "llama-server",
        help="llama.cpp's server (.peers/llamacpp/avx2/llama-server: built for AVX2 only, make peer-llamacpp-avx2)",
    )
    parser.add_argument("--q8-gguf", type=Path, default=PEERS / "llamacpp" / f"{DEFAULT_MODEL}.Q8_0.gguf")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", help="results file stem; default serving_compare (serving_compare_quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.rounds = "1,16", 16, 1
    args.name = args.name or ("serving_compare_quick" if args.quick else "serving_compare")

    configs = [spec.partition("=") for spec in args.vattn or DEFAULT_VATTN]
    systems = [vattn_system(name, extra) for name, _, extra in configs]
    systems += [
        vllm_system(args.model_dir, "float32"),
        vllm_system(args.model_dir, "bfloat16"),
        llamacpp_system("llamacpp-f32", "fp32", args.f32_gguf, args.llama_server, kv="f32"),
        llamacpp_system("llamacpp-q8_0", "int8", args.q8_gguf, args.llama_server, kv="f16"),
        llamacpp_system("llamacpp-q4_1", "q4", args.q4_gguf, args.llama_server, kv="f16"),
        hf_system(args.model_dir, args.output_tokens),
    ]
    if args.systems:
        wanted = set(args.systems.split(","))
        unknown = wanted - {s.name for s in systems} - {"vattn"}
        if unknown:
            parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
        systems = [s for s in systems if s.name in wanted or ("vattn" in wanted and s.name.startswith("vattn-"))]
    return args, systems


def main(argv: Sequence[str] | None = None) -> None:
    args, systems = parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    # Fresh prompts for the warm-up and for each level of each round, the same for every system: a
    # prefix cache must not serve a level from the prompts of an earlier one (with one set per
    # level, vLLM's served rounds 2 and 3 from its cache: c=48 bf16 303 -> 465, 482 tok/s).
    runs = [(r, c) for r in range(1, args.rounds + 1) for c in concurrencies]
    count = args.requests * len(runs)
    prompts = random_word_prompts(count + max(concurrencies), args.shortest, args.longest, args.seed)
    levels = [(r, c, prompts[i * args.requests : (i + 1) * args.requests]) for i, (r, c) in enumerate(runs)]
    logs = Path(tempfile.mkdtemp(prefix="serving_compare-"))
    infos, rows = [], []
    with ExitStack() as stack:
        servers = []
        for system in systems:
            info, server = start_server(system, prompts[count:], args, logs, stack)
            infos.append(info)
            servers += [server] if server else []
        turns = [(level, server) for level in levels for server in servers]
        for (round_number, concurrency, level_prompts), server in tqdm(turns, desc="levels x systems x rounds"):
            for each in servers:
                pause_session(each.process.pid, each is not server)
            try:
                rows.append(measure_level(server, concurrency, level_prompts, round_number, args.output_tokens))
            except Exception as error:
                print(f"{server.system.name} failed at c={concurrency}: {type(error).__name__}: {error}")
            save(args, rows, infos)
    save(args, rows, infos)
    print_summary(rows, infos)
    print(f"server logs: {logs}")


def save(args: argparse.Namespace, rows: list[dict[str, Any]], infos: list[dict[str, Any]]) -> None:
    """Results so far: the medians as the CSV, every round and the ratios in the JSON, and the plot."""
    summary = medians(rows)
    payload = {"command": command_line(), "machine": machine_facts(), "settings": vars(args), "systems": infos}
    payload |= {"rows": summary, "rounds": rows, "comparisons": comparisons(rows)}
    _, _, png = write_results(args.out, args.name, summary, payload)
    if summary:
        title = f"{args.requests} requests per level, {args.output_tokens} output tokens, streaming, median of rounds"
        plot(summary, png, title)


def print_summary(rows: list[dict[str, Any]], infos: list[dict[str, Any]]) -> None:
    print_table(
        medians(rows),
        [
            ("system", "system", 16, ""),
            ("conc", "concurrency", 5, ""),
            ("tok/s", "output_tokens_per_s", 7, ".1f"),
            ("min", "output_tokens_per_s_min", 7, ".1f"),
            ("max", "output_tokens_per_s_max", 7, ".1f"),
            ("TTFT p50", "ttft_p50_s", 9, ".2f"),
            ("TTFT p99", "ttft_p99_s", 9, ".2f"),
            ("TPOT p50", "tpot_p50_ms", 9, ".0f"),
            ("TPOT p99", "tpot_p99_ms", 9, ".0f"),
            ("RSS MiB", "peak_rss_mib", 8, ".0f"),
        ],
        "serving comparison, median of rounds (TTFT s, TPOT ms, peak RSS of the server's process tree)",
    )
    print_table(
        comparisons(rows),
        [
            ("system", "system", 16, ""),
            ("against", "peer", 16, ""),
            ("conc", "concurrency", 5, ""),
            ("median", "median", 7, ".2f"),
            ("min", "min", 6, ".2f"),
            ("max", "max", 6, ".2f"),
        ],
        "tokens/s ratios within a precision class, round by round",
    )
    for info in infos:
        status = info.get("error") or (f"skipped: {info['skip']}" if info["skip"] else "ok")
        print(f"{info['name']}: {info['version']}: {status.splitlines()[0]}")


if __name__ == "__main__":
    main()

"""Replicas behind vllm-router on this machine: two replicas of one core each against one of two.

Workload: `--system-prompts` system prompts of 500-1,000 tokens (common English words, seeded)
and `--questions` different questions of 20-40 words; request k is question k after system
prompt k mod 8, sent in a seeded shuffled order with `--concurrency` in flight, 32 output
tokens each (ignore_eos). Three set-ups, each started by `vattn replicas` (serving.server.replicas)
with a router in front (`make router router-smg`), the same 1 GiB of KV in all:
- one replica with both cores and a 1 GiB KV budget (behind vllm-router);
- two replicas pinned to one core each, 512 MiB each, vllm-router's `cache_aware` policy;
- the same with vllm-router's `round_robin`, and with SMG's `cache_aware`.
Figures: output tokens/s, TTFT p50/p99, and the prefix-cache hit rate summed over the replicas
(their `vllm:prefix_cache_hits` over `queries`). On two cores the router and this client
share the replicas' cores, so two replicas show what routing keeps, not a speed-up.

Then a replica killed mid-load (two replicas, `cache_aware`): SIGKILL once half the requests
are done; the requests lost, and how long the router kept routing to the dead replica: from the
kill to the last request that failed, and to when `/list_workers` changed.

    python -m benchmarks.scale_out [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from measure.results import (
    RESULTS_DIR,
    command_line,
    exit_on_sigterm,
    free_port,
    machine_facts,
    save_figure,
    write_results,
)
from measure.streams import Timing, http_client, one_request, summarize
from measure.workloads import WORDS
from serving.server.replicas import ReplicaPlan, ReplicaSet, free_port_run

SETUPS = (
    ("1 replica, 2 cores", 1, None, "vllm-router", "round_robin", "1G"),
    ("2 replicas x 1 core, vllm-router cache_aware", 2, 1, "vllm-router", "cache_aware", "512M"),
    ("2 replicas x 1 core, vllm-router round_robin", 2, 1, "vllm-router", "round_robin", "512M"),
    ("2 replicas x 1 core, SMG cache_aware", 2, 1, "smg", "cache_aware", "512M"),
)
"""(name, replicas, CPUs each (None: share both), router, its policy, KV budget of each)."""
OUTPUT_TOKENS = 32
COLORS = ["tab:blue", "tab:green", "tab:orange", "tab:red"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def workload(system_prompts: int, questions: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(WORDS, k=rng.randint(400, 800))) for _ in range(system_prompts)]
    asked = [" ".join(rng.choices(WORDS, k=rng.randint(20, 40))) + "?" for _ in range(questions)]
    prompts = [f"{systems[k % system_prompts]}\n\nQuestion: {question}\nAnswer:" for k, question in enumerate(asked)]
    rng.shuffle(prompts)
    return prompts


def prefix_counts(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) in a replica's prefix cache; zeros for a dead replica."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("vllm:prefix")}
    return values.get("vllm:prefix_cache_queries_total", 0.0), values.get("vllm:prefix_cache_hits_total", 0.0)


async def drive(
    router: str, prompts: Sequence[str], concurrency: int, on_half: Any = None
) -> tuple[list[Timing], list[float], float]:
    """Sends the prompts, `concurrency` in flight; (completed timings, send times of failed ones,
    seconds). `on_half()` runs once half of them have completed."""
    client = http_client(timeout=300)
    model = (await client.get(f"{router}/v1/models")).json()["data"][0]["id"]
    queue = list(prompts)
    done: list[Timing] = []
    failed: list[float] = []
    half = asyncio.Event()
    bar = tqdm(total=len(prompts), desc="requests", leave=False)

    async def worker() -> None:
        while queue:
            prompt = queue.pop(0)
            sent = time.perf_counter()
            try:
                timing = await one_request(client, router, model, prompt, OUTPUT_TOKENS)
                if timing.tokens == OUTPUT_TOKENS:
                    done.append(timing)
                else:
                    failed.append(sent)
            except httpx.HTTPError:
                failed.append(sent)
            bar.update()
            if len(done) + len(failed) >= len(prompts) // 2 and not half.is_set():
                half.set()
                if on_half is not None:
                    on_half()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    await client.aclose()
    return done, failed, time.perf_counter() - started


def cluster_plan(replicas: int, cpus: int | None, router: str, policy: str, budget: str) -> ReplicaPlan:
    first = free_port_run(replicas)
    return ReplicaPlan(
        replicas=replicas,
        router=router,
        policy=policy,
        host="127.0.0.1",
        port=free_port(),
        first_port=first,
        serve_args=("--max-slots", "16", "--max-context", "1400", "--kv-budget", budget, "--log-level", "warning"),
        cpus_per_replica=cpus,
        router_args=("--log-level", "warning") if router == "vllm-router" else (),
    )


def run_setup(
    name: str,
    replicas: int,
    cpus: int | None,
    router: str,
    policy: str,
    budget: str,
    args: argparse.Namespace,
    prompts: list[str],
) -> dict[str, Any]:
    plan = cluster_plan(replicas, cpus, router, policy, budget)
    cluster = ReplicaSet(plan)
    cluster.start()
    try:
        asyncio.run(drive(plan.router_url, prompts[:8], args.concurrency))  # warm-up: no system prompt reused yet
        before = [prefix_counts(url) for url in plan.replica_urls]
        done, failed, seconds = asyncio.run(drive(plan.router_url, prompts[8:], args.concurrency))
        after = [prefix_counts(url) for url in plan.replica_urls]
    finally:
        cluster.stop()
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "table": "setups",
        "setup": name,
        "failed": len(failed),
        **summarize(done, seconds),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
    }


def run_kill(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """Two replicas under load, one SIGKILLed once half the requests are done; the router's own log
    (read as it is written) says which requests it still sent to the dead one, and when its
    circuit breaker opened."""
    plan = cluster_plan(2, 1, "vllm-router", "cache_aware", "512M")
    cluster = ReplicaSet(plan, router_output=subprocess.PIPE)
    cluster.start()
    assert cluster.router is not None and cluster.router.stdout is not None
    log_lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: log_lines.extend((time.perf_counter(), line) for line in cluster.router.stdout),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    dead_url, killed = plan.replica_urls[1], {}

    def kill() -> None:
        os.kill(cluster.replicas[1].pid, signal.SIGKILL)
        killed["at"] = time.perf_counter()

    try:
        done, failed, seconds = asyncio.run(drive(plan.router_url, prompts, args.concurrency, on_half=kill))
    finally:
        cluster.stop()
        reader.join(10)
    after = [(at - killed["at"], ANSI.sub("", line)) for at, line in log_lines if at >= killed["at"]]
    sent_to_dead = [at for at, line in after if "Failed to send" in line and dead_url in line]
    opened = [at for at, line in after if "closed -> open" in line]
    return {
        "table": "replica killed",
        "setup": "2 replicas x 1 core, cache_aware, one SIGKILLed halfway",
        "requests": len(prompts),
        "failed": len(failed),
        "failed_sent_before_kill": sum(sent < killed["at"] for sent in failed),
        "completed": len(done),
        "sends_to_the_dead_replica_after_kill": len(sent_to_dead),
        "last_send_to_it_after_s": round(max(sent_to_dead), 3) if sent_to_dead else None,
        "circuit_opened_after_s": round(opened[0], 3) if opened else None,
        **{k: v for k, v in summarize(done, seconds).items() if k.startswith("ttft")},
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    setups = [r for r in rows if r["table"] == "setups"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["setup"].replace(", ", "\n") for r in setups]
    for axis, key, label in (
        (axes[0], "output_tokens_per_s", "output tokens/s"),
        (axes[1], "ttft_p50_s", "TTFT p50 (s)"),
        (axes[2], "prefix_hit_rate", "prefix-cache hit rate"),
    ):
        axis.bar(
            names, [r[key] for r in setups], color=["tab:blue", "tab:green", "tab:orange", "tab:red"][: len(setups)]
        )
        axis.set_ylabel(label)
        axis.tick_params(axis="x", labelsize=7)
    save_figure(fig, path, command_line())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a tiny run that checks the script")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.questions, args.concurrency = 24, 4
    exit_on_sigterm()
    prompts = workload(args.system_prompts, args.questions + 8, seed=0)
    rows = [run_setup(*setup, args, prompts) for setup in tqdm(SETUPS, desc="set-ups")]
    rows.append(run_kill(args, prompts[8:]))
    payload = {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows}
    csv_path, json_path, png_path = write_results(args.out, "scale_out", rows, payload)
    for row in rows:
        print(row)
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()

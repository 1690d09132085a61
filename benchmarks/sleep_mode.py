"""Sleep mode: what sleeping gives back and what waking costs, against a cold start.

One engine (`LLM(enable_sleep_mode=True)`, the default model and precision) serves `--requests`
greedy requests at once to fill its KV cache, then, for each level, sleeps and wakes (all tags)
`--rounds` times. Reported per level: the process's resident memory awake (after the requests),
asleep and awake again, seconds to sleep and to wake, and the first request's latency after
waking; beside them the seconds a cold start takes (building a new engine) and its first
request's latency. Resident memory is VmRSS from /proc/self/status after glibc returns its free
heap (what another process on the machine could then use).

    python -m benchmarks.sleep_mode [--requests 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import random_word_prompts
from serving import LLM, SamplingParams
from serving.heap import return_freed_memory

PROMPT = "The capital of France is"


def resident_mib() -> float:
    return_freed_memory()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def first_request_s(llm: LLM) -> float:
    started = time.perf_counter()
    llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = random_word_prompts(args.requests, 200, 400, seed=0)
    fill = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    llm = LLM(enable_sleep_mode=True, max_slots=args.requests, max_context=1024)
    cold_start = time.perf_counter() - started
    cold_first = first_request_s(llm)
    rows = [{"level": "cold start", "wake_s": cold_start, "first_request_s": cold_first}]
    for level in tqdm((1, 2), desc="levels"):
        samples: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            llm.generate(prompts, fill, use_tqdm=False)
            awake = resident_mib()
            started = time.perf_counter()
            llm.sleep(level)
            slept = time.perf_counter() - started
            asleep = resident_mib()
            started = time.perf_counter()
            llm.wake_up()
            woke = time.perf_counter() - started
            first = first_request_s(llm)
            values = {"rss_awake_mib": awake, "rss_asleep_mib": asleep, "rss_woken_mib": resident_mib()}
            values |= {"sleep_s": slept, "wake_s": woke, "first_request_s": first}
            for key, value in values.items():
                samples.setdefault(key, []).append(value)
        rows.append({"level": str(level)} | {key: statistics.median(v) for key, v in samples.items()})
    llm.close()
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 3.5))
    levels = [row for row in rows if row["level"] != "cold start"]
    for i, row in enumerate(levels):
        values = [row["rss_awake_mib"], row["rss_asleep_mib"], row["rss_woken_mib"]]
        memory.bar([3 * i, 3 * i + 1, 3 * i + 2], values, color=["tab:blue", "tab:grey", "tab:green"])
    memory.set_xticks([3 * i + 1 for i in range(len(levels))], [f"level {row['level']}" for row in levels])
    memory.set_ylabel("resident MiB: awake / asleep / woken")
    names = [f"wake, level {row['level']}" for row in levels] + ["cold start"]
    cold = next(row for row in rows if row["level"] == "cold start")
    seconds.barh(names, [row["wake_s"] for row in levels] + [cold["wake_s"]], label="to serve again")
    seconds.barh(
        names,
        [row["first_request_s"] for row in levels] + [cold["first_request_s"]],
        left=[row["wake_s"] for row in levels] + [cold["wake_s"]],
        label="first request",
    )
    seconds.set_xlabel("seconds")
    seconds.legend(fontsize=7)
    save_figure(fig, path, "sleep mode: memory and time to serve again")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    rows = measure(args)
    payload = {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows}
    csv_path, json_path, png_path = write_results(args.out, "sleep_mode", rows, payload)
    columns = [
        ("level", "level", 11, ""),
        ("RSS awake", "rss_awake_mib", 10, ".0f"),
        ("asleep", "rss_asleep_mib", 8, ".0f"),
        ("woken", "rss_woken_mib", 8, ".0f"),
        ("sleep s", "sleep_s", 8, ".3f"),
        ("wake s", "wake_s", 8, ".3f"),
        ("1st request s", "first_request_s", 14, ".3f"),
    ]
    print_table(rows, columns, f"sleep and wake, median of {args.rounds} rounds (resident MiB)")
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()

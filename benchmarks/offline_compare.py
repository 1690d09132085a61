"""Offline generation against OpenVINO GenAI, the strongest CPU peer: the same prompts through
vattn's `LLM.generate` and OpenVINO GenAI's `ContinuousBatchingPipeline`, at equal weight
precision.

The workload: seeded prompts of 128-512 common English words (tokenized by the model's tokenizer,
the same ids for every system), all submitted at once, greedy, 64 new tokens each with EOS
ignored, 2 threads, KV space as the serving comparison gives every system (measure.peers.KV_SPACE_GIB:
vattn's kv_budget, OpenVINO's cache_size). Each system runs in a process of its own, once per round, the rounds
alternating between systems (the machine's noise falls on all of them). Reported: output
tokens/s per round and their mean, peak RSS, and greedy agreement with vattn fp32 (the share of
prompts whose 64 tokens are all equal, and the mean length of the common prefix). The results
are written after every round (`rounds_done` says how many all systems finished): a run cut
short, as in a lent quarter hour, keeps what it measured.

OpenVINO runs from the model's IRs that `make peer-openvino` exports with optimum-intel
(`--weight-format fp32` and `int8`: per-channel int8 weights), with its inference precision
pinned to f32 or bf16, or at its defaults (on a CPU with AVX512_BF16 or AMX: bf16 compute and
u8 KV), and its KV cache in f32 or at its default precision.

Systems compare within a precision class (`fp32`, `bf16`, `int8`), each vattn system against
OpenVINO's system of its class (`PEER_OF_CLASS`), and vattn's default configuration against
OpenVINO at its defaults (`defaults`: what a user who starts each gets): per round, the
ratio of the two rounds' output tokens/s; reported, the median and the range over rounds.

    python -m benchmarks.offline_compare [--prompts 64] [--rounds 3] [--systems vattn-fp32,openvino-fp32-f32kv]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from measure.peers import KV_SPACE_GIB, PEERS, dist_version, missing, run_driver
from measure.results import (
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    machine_facts,
    print_table,
    ratio_range,
    save_figure,
    write_results,
)
from measure.workloads import engine_options, random_word_prompts
from serving.config import EngineConfig
from serving.default_model import ensure_default_model
from serving.model.synthetic import build_tokenizer, is_synthetic, synthetic_spec

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OPENVINO = PEERS / "openvino"
DRIVER = REPO_ROOT / "benchmarks" / "peer_drivers" / "openvino_offline.py"


@dataclass(frozen=True)
class System:
    name: str
    precision: str  # its class: "fp32", "fp32-narrowkv", "bf16" or "int8" (the comparison is within a class)
    vattn_config: str | None = None  # a measure.workloads configuration
    ir: str | None = None  # OpenVINO's IR folder under .peers/openvino/
    kv_precision: str | None = None  # OpenVINO's KV_CACHE_PRECISION; None: its default
    inference_precision: str | None = "f32"  # OpenVINO's INFERENCE_PRECISION_HINT; None: its default

    @property
    def kv(self) -> str:
        """The KV cache's precision as the results name it."""
        if self.vattn_config:
            kv = EngineConfig(**engine_options(self.vattn_config)).kv_torch_dtype  # auto resolved here
            return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int8: "i8"}[kv]
        return self.kv_precision or "default"


SYSTEMS = (
    System("vattn-default", "defaults", vattn_config="default"),
    System("vattn-fp32", "fp32", vattn_config="fp32"),
    System("vattn-f16kv", "fp32-narrowkv", vattn_config="f16kv"),
    System("vattn-bf16", "bf16", vattn_config="bf16"),
    System("vattn-bf16w", "bf16", vattn_config="bf16w"),
    System("vattn-bf16kv8", "bf16", vattn_config="bf16kv8"),  # bf16 compute over an int8 KV cache, as OpenVINO's u8
    System("vattn-w8", "int8", vattn_config="w8"),
    System("vattn-q8", "int8", vattn_config="q8"),
    System("openvino-fp32-f32kv", "fp32", ir="ir-fp32", kv_precision="f32"),
    System("openvino-fp32-defaultkv", "fp32", ir="ir-fp32"),
    System("openvino-bf16", "bf16", ir="ir-fp32", inference_precision="bf16"),
    System("openvino-defaults", "defaults", ir="ir-fp32", inference_precision=None),
    System("openvino-int8-f32kv", "int8", ir="ir-int8", kv_precision="f32"),
    System("openvino-int8-defaultkv", "int8", ir="ir-int8"),
)
PEER_OF_CLASS = {
    "fp32": "openvino-fp32-f32kv",
    "fp32-narrowkv": "openvino-fp32-defaultkv",
    "bf16": "openvino-bf16",
    "int8": "openvino-int8-f32kv",
}
"""The OpenVINO system each vattn system of a class is compared with (f32 KV where it has it,
as vattn's presets keep theirs unless they say otherwise; fp32 compute over a narrower KV cache
against OpenVINO's fp32 over its default KV, u8 on the CPU)."""
DEFAULTS = ("vattn-default", "openvino-defaults")
"""vattn's defaults (dtype auto) and OpenVINO's: what a user who starts each gets."""


def vattn_round(config: str, prompts: list[list[int]], max_tokens: int, model: str | None) -> dict[str, Any]:
    """One round in this (child) process: build, warm up on one prompt, generate every prompt."""
    from serving import LLM, SamplingParams

    longest = max(map(len, prompts)) + max_tokens
    options = engine_options(config) | ({"model": model} if model else {})
    space = KV_SPACE_GIB << 30
    llm = LLM(max_slots=len(prompts), max_context=longest, prefix_caching=False, kv_budget=space, **options)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        llm.close()
    return {
        "seconds": seconds,
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "outputs": [o.token_ids for o in outputs],
    }


def openvino_round(system: System, prompts_file: Path, max_tokens: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        command = [str(OPENVINO / "bin" / "python"), str(DRIVER), str(OPENVINO / str(system.ir)), str(prompts_file)]
        command += [str(out), "--threads", str(threads), "--max-tokens", str(max_tokens)]
        command += ["--cache-size", str(KV_SPACE_GIB)]
        command += ["--inference-precision", system.inference_precision] if system.inference_precision else []
        command += ["--kv-precision", system.kv_precision] if system.kv_precision else []
        run_driver(command)
        return json.loads(out.read_text())


def skip_reason(system: System) -> str | None:
    if system.ir is None:
        return None
    return missing(OPENVINO / "bin" / "python", OPENVINO / system.ir, target="peer-openvino")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=128)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(s.name for s in SYSTEMS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="offline_compare", help="results file stem")
    parser.add_argument(
        "--model",
        help="vattn's model (default: the default model); e.g. synthetic:smollm2, its shape with random weights, "
        "where its weights cannot travel (OpenVINO's IRs stay the default model's)",
    )
    args = parser.parse_args(argv)
    known = {s.name: s for s in SYSTEMS}
    unknown = [name for name in args.systems.split(",") if name not in known]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(known)}")
    args.systems = [known[name] for name in args.systems.split(",")]
    if args.model and any(system.ir for system in args.systems):
        parser.error("--model runs vattn's systems only (--systems vattn-...): OpenVINO's IRs are the default model's")
    return args


def measure(
    args: argparse.Namespace, prompts: list[list[int]], save: Callable[[dict[str, list[dict[str, Any]]]], object]
) -> dict[str, list[dict[str, Any]]]:
    """Every system's rounds, alternating; systems that cannot run here are skipped. `save` gets
    the rounds so far after each one (a run cut short keeps what it measured)."""
    runnable = [s for s in args.systems if skip_reason(s) is None]
    for system in args.systems:
        if reason := skip_reason(system):
            print(f"skipping {system.name}: {reason}")
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in runnable}
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch:
        prompts_file = Path(scratch) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        runs = [(r, s) for r in range(args.rounds) for s in runnable]
        for _, system in tqdm(runs, desc="rounds"):
            if system.vattn_config:
                with spawn.Pool(1) as pool:
                    result = pool.apply(vattn_round, (system.vattn_config, prompts, args.max_tokens, args.model))
            else:
                result = openvino_round(system, prompts_file, args.max_tokens, args.threads)
            rounds[system.name].append(result)
            save(rounds)
    return rounds


def tabulate(systems: list[System], rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    reference = (rounds.get("vattn-fp32") or [{}])[0].get("outputs")
    rows = []
    for system in systems:
        if system.name not in rounds:
            continue
        results = rounds[system.name]
        if not results:
            continue
        speeds = [r["output_tokens"] / r["seconds"] for r in results]
        row: dict[str, Any] = {"system": system.name, "precision": system.precision, "kv": system.kv}
        row |= {f"round_{i + 1}_tok_s": s for i, s in enumerate(speeds)}
        row |= {"out_tok_s": mean(speeds), "peak_rss_mib": max(r["peak_rss_bytes"] for r in results) / 2**20}
        if reference is not None:
            outputs = results[0]["outputs"]
            row["same_greedy"] = sum(a == b for a, b in zip(outputs, reference, strict=True)) / len(reference)
            row["common_prefix"] = mean(common_prefix(a, b) for a, b in zip(outputs, reference, strict=True))
        rows.append(row)
    return rows


def round_speeds(row: dict[str, Any]) -> list[float]:
    """A row's output tokens/s, round by round."""
    return [row[f"round_{i}_tok_s"] for i in range(1, len(row)) if f"round_{i}_tok_s" in row]


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each vattn row against the OpenVINO row of its class, and vattn's default against
    OpenVINO's: the ratio of their tokens/s round by round, its median and range."""
    by_name = {row["system"]: row for row in rows}
    pairs = [(row["system"], PEER_OF_CLASS.get(row["precision"])) for row in rows if row["system"].startswith("vattn")]
    found = []
    for name, peer in [*pairs, DEFAULTS]:
        if name in by_name and peer in by_name:
            ours, theirs = round_speeds(by_name[name]), round_speeds(by_name[peer])
            paired = min(len(ours), len(theirs))  # fewer where a run was cut short
            ratios = ratio_range(ours[:paired], theirs[:paired])
            found.append({"system": name, "peer": peer} | ratios)
    return found


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(
        [r["system"] for r in rows],
        [r["out_tok_s"] for r in rows],
        color=["tab:blue" if r["system"].startswith("vattn") else "tab:grey" for r in rows],
    )
    for i, row in enumerate(rows):
        ax.text(row["out_tok_s"], i, f" {row['out_tok_s']:.1f}", va="center")
    ax.set_xlabel("output tokens/s (mean of rounds)")
    ax.set_xlim(0, max(r["out_tok_s"] for r in rows) * 1.25)
    save_figure(fig, path, "offline generation, same prompts, 2 threads")


def versions() -> dict[str, str]:
    return {dist: dist_version(OPENVINO, dist) for dist in ("openvino", "openvino-genai", "optimum-intel")}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model and is_synthetic(args.model):
        tokenizer = build_tokenizer(synthetic_spec(args.model).vocab_size)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model or ensure_default_model())
    words = random_word_prompts(args.prompts, args.shortest, args.longest, seed=0)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in words]
    workload = {"model": args.model or "default", "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts))}
    workload |= {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": args.threads}
    machine, peer_versions = machine_facts(), versions()

    def save(rounds: dict[str, list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
        rows = tabulate(args.systems, rounds)
        ratios = comparisons(rows)
        done = {"rounds_done": min(map(len, rounds.values()), default=0)}
        payload = {"command": command_line(), "machine": machine, "workload": workload | done, "rows": rows}
        payload |= {"comparisons": ratios, "peer_versions": peer_versions}
        _, json_path, png_path = write_results(args.out, args.name, rows, payload)
        if rows:
            plot(rows, png_path)
        return rows, ratios, json_path

    rows, ratios, json_path = save(measure(args, prompts, save))
    print_table(
        rows,
        [
            ("system", "system", 24, ""),
            ("out tok/s", "out_tok_s", 10, ".1f"),
            ("RSS MiB", "peak_rss_mib", 8, ".0f"),
            ("same greedy", "same_greedy", 12, ".1%"),
            ("common prefix", "common_prefix", 14, ".1f"),
        ],
        f"{len(prompts)} prompts, {args.max_tokens} greedy tokens each, {args.threads} threads",
    )
    ratio_columns = [("system", "system", 24, ""), ("against", "peer", 24, ""), ("median", "median", 7, ".2f")]
    ratio_columns += [("min", "min", 6, ".2f"), ("max", "max", 6, ".2f")]
    print_table(ratios, ratio_columns, "tokens/s ratios, round by round")
    print(f"wrote {json_path} and its .csv and .png")


if __name__ == "__main__":
    main()

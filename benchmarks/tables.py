"""The READMEs' result tables, generated from the committed results files, never typed.

    python -m benchmarks.tables           # rewrites every generated table in place
    python -m benchmarks.tables --check   # exit status 1 if a table differs from its results file

A generated table sits between `<!-- generated: NAME -->` and `<!-- end generated -->` in
README.md or benchmarks/README.md; NAME is one of TABLES, each a function of its results file
(benchmarks/results/NAME.json; NAME.PART is another table of the same file). Every other table
with a figure (a decimal, a percentage or a ratio) cites its results files (`results/NAME.*`,
`.csv` or `.json`) in the lines before it, and each of its numbers is in one of them
(`benchmarks.figures.unsourced`): as stored, rounded as printed, as a percentage, or as the ratio of two values
stored under one key. tests/test_tables.py runs both checks (a figure from no file fails them).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.figures import unsourced
from benchmarks.offline_compare import comparisons, round_speeds
from measure.results import REPO_ROOT, RESULTS_DIR
from vattn.sizes import MiB

READMES = (REPO_ROOT / "README.md", REPO_ROOT / "benchmarks" / "README.md")
BLOCK = re.compile(r"(<!-- generated: (\S+) -->\n)(.*?)(<!-- end generated -->)", re.DOTALL)


def offline_compare(results: dict[str, Any]) -> str:
    """vattn and OpenVINO offline: each round's tokens/s, memory, greedy answers equal to vattn
    fp32's; then each vattn system against OpenVINO's of its class, and the defaults against
    each other (the ratio round by round: median and range, from the rounds in the file)."""
    machine = results["machine"]
    onednn = machine.get("onednn", {})
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores, oneDNN ISA: {onednn.get('isa', 'not recorded')} "
        f"(bf16 projections on `{onednn.get('implementations', {}).get('bfloat16', '?')}`); "
        f"commit {machine['git_commit'][:7]}; `{results['command']}`",
        "",
        "| system | class | KV | out tok/s by round | mean | peak RSS | greedy answers equal to vattn fp32's "
        "(mean common prefix of 64) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        rounds = " / ".join(f"{speed:.1f}" for speed in round_speeds(row))
        agreement = f"{row['same_greedy']:.1%} ({row['common_prefix']:.1f})" if "same_greedy" in row else ""
        lines.append(
            f"| {row['system']} | {row['precision']} | {row['kv']} | {rounds} | {row['out_tok_s']:.1f} | "
            f"{row['peak_rss_mib']:,.0f} MiB | {agreement} |"
        )
    return "\n".join(lines) + "\n\n" + offline_ratios(results)


def offline_ratios(results: dict[str, Any]) -> str:
    """Each vattn system against OpenVINO's of its class, and the defaults against each other:
    the ratio of tokens/s round by round (the rounds in the file), its median and range."""
    lines = ["| vattn | against | tokens/s ratio, median of rounds | range |", "|---|---|---|---|"]
    for ratio in comparisons(results["rows"]):
        lines.append(
            f"| {ratio['system']} | {ratio['peer']} | {ratio['median']:.2f}x | {ratio['min']:.2f}-{ratio['max']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def quality(results: dict[str, Any]) -> str:
    """Perplexity and next-token agreement of each system and preset against its float reference."""
    machine = results["machine"]
    lines = [
        f"{machine['cpu_model']}, commit {machine['git_commit'][:7]}; `{results['command']}`\n",
        "| system | preset | perplexity | vs its float | same top-1 |\n|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        change = f"{row['perplexity_change']:+.2%}" if row["perplexity_change"] else ""
        agreement = f"{row['top1_agreement']:.2%}" if row["top1_agreement"] != 1.0 else ""
        lines.append(f"| {row['system']} | {row['preset']} | {row['perplexity']:.4f} | {change} | {agreement} |")
    return "\n".join(lines) + "\n"


def serving_compare(results: dict[str, Any]) -> str:
    """The served comparison: per system and level the median of the rounds (tokens/s with its
    range), then the ratios within each precision class (none where no two systems share one)."""
    machine, settings = results["machine"], results["settings"]
    onednn = machine.get("onednn", {})
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores, oneDNN ISA: {onednn.get('isa', 'not recorded')}; "
        f"{settings['rounds']} alternating rounds; commit {machine['git_commit'][:7]}; `{results['command']}`",
        "",
        "| system | class | requests in flight | out tok/s, median (range) | TTFT p50 | TPOT p50 | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        speed = row["output_tokens_per_s"]
        spread = f"{row['output_tokens_per_s_min']:.1f}-{row['output_tokens_per_s_max']:.1f}"
        lines.append(
            f"| {row['system']} | {row['precision']} | {row['concurrency']} | {speed:.1f} ({spread}) | "
            f"{row['ttft_p50_s']:.2f} s | {row['tpot_p50_ms']:.0f} ms | {row['peak_rss_mib']:,.0f} MiB |"
        )
    table = "\n".join(lines) + "\n"
    return table + "\n" + serving_ratios(results) if results["comparisons"] else table


def serving_ratios(results: dict[str, Any]) -> str:
    """Each vattn system against each peer of its class (and vattn's default against the peer's,
    `defaults`), level by level: the tokens/s ratio round by round, its median and range."""
    lines = [
        "| vattn | against | class | requests in flight | tokens/s ratio, median | range |",
        "|---|---|---|---|---|---|",
    ]
    for ratio in results["comparisons"]:
        lines.append(
            f"| {ratio['system']} | {ratio['peer']} | {ratio['precision']} | {ratio['concurrency']} | "
            f"{ratio['median']:.2f}x | "
            f"{ratio['min']:.2f}-{ratio['max']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def sleep_mode(results: dict[str, Any]) -> str:
    """Sleep and wake against a cold start: resident memory, seconds, first request after."""
    machine = results["machine"]
    lines = [
        f"{machine['cpu_model']}, commit {machine['git_commit'][:7]}; `{results['command']}`; median of "
        f"{results['args']['rounds']} rounds",
        "",
        "| | resident awake | asleep | woken | to sleep | to serve again | first request after |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        name = row["level"] if row["level"] == "cold start" else f"level {row['level']}"
        memory = [
            f"{row[k]:,.0f} MiB" if k in row else "" for k in ("rss_awake_mib", "rss_asleep_mib", "rss_woken_mib")
        ]
        slept = f"{row['sleep_s']:.3f} s" if "sleep_s" in row else ""
        lines.append(
            f"| {name} | {' | '.join(memory)} | {slept} | {row['wake_s']:.3f} s | {row['first_request_s']:.3f} s |"
        )
    return "\n".join(lines) + "\n"


def shared_budget(results: dict[str, Any]) -> str:
    """Two models in bursts: one shared KV budget against a static split, median (range) of the rounds."""
    machine = results["machine"]
    lines = [
        f"{machine['cpu_model']}, commit {machine['git_commit'][:7]}; `{results['command']}`; "
        f"{results['budget_bytes'] / MiB:.0f} MiB of KV; median (range) of {results['args']['rounds']} rounds",
        "",
        "| KV budget | requests/s | TTFT p50 | TTFT p99 |",
        "|---|---|---|---|",
    ]
    names = {"shared": "one budget, shared", "static": "split in half"}
    for row in results["rows"]:
        cells = [
            f"{row[f'{metric}_median']:.2f}{unit} ({row[f'{metric}_min']:.2f}-{row[f'{metric}_max']:.2f})"
            for metric, unit in (("requests_per_s", ""), ("ttft_p50_s", " s"), ("ttft_p99_s", " s"))
        ]
        lines.append(f"| {names[row['mode']]} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


EQUAL_QUALITY = {  # serving system: its label, its quality row (system, preset), its peer of the same precision
    "vattn-q8": ("vattn `q8_0`, f16 KV (Q8_0's arithmetic and KV)", ("vattn", "q8"), "llamacpp-q8_0"),
    "vattn-w8": ("vattn `int8_weight_only`", ("vattn", "w8"), "llamacpp-q8_0"),
    "llamacpp-q8_0": ("llama.cpp Q8_0", ("llama.cpp", "Q8_0"), None),
    "vattn-q4_1-gguf": ("vattn `gguf` (the Q4_1 file as stored)", ("vattn", "gguf"), "llamacpp-q4_1"),
    "llamacpp-q4_1": ("llama.cpp Q4_1", ("llama.cpp", "Q4_1"), None),
    "vattn-fp32": ("vattn fp32", ("vattn", "fp32"), "vllm"),
    "vllm": ("vLLM fp32 (CPU build, both cores)", ("vLLM", "fp32"), None),
    "llamacpp-f32": ("llama.cpp F32", ("llama.cpp", "F32"), None),
}


def equal_quality(results: dict[str, Any]) -> str:
    """The equal-precision serving run beside each system's quality (results/quality.json): tokens/s
    per level, each vattn row with its ratio to the peer of its precision."""
    quality = {(r["system"], r["preset"]): r for r in json.loads((RESULTS_DIR / "quality.json").read_text())["rows"]}
    speed = {(r["system"], r["concurrency"]): r["output_tokens_per_s"] for r in results["rows"]}
    levels = sorted({c for _, c in speed})
    lines = [
        "| system | perplexity (vs its fp32) | same next token | " + " | ".join(f"tok/s c={c}" for c in levels) + " |",
        "|---|---|---|" + "---|" * len(levels),
    ]
    commands = {info["name"]: info["command"].split() for info in results["systems"]}
    for system, (label, scored, peer) in EQUAL_QUALITY.items():
        if (system, levels[0]) not in speed:
            continue
        if system.startswith("llamacpp"):  # its KV precision as run: --cache-type-k, or its default f16
            command = commands[system]
            kv = command[command.index("--cache-type-k") + 1] if "--cache-type-k" in command else "f16, its default"
            label += f" ({kv} KV)"
        q = quality[scored]
        cells = [
            f"{speed[system, c]:.1f}" + (f" ({speed[system, c] / speed[peer, c]:.2f}x {peer})" if peer else "")
            for c in levels
        ]
        lines.append(
            f"| {label} | {q['perplexity']:.4f} ({q['perplexity_change']:+.2%}) | {q['top1_agreement']:.2%} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def few_rows(results: dict[str, Any]) -> str:
    """Few-row projections: vattn::tiled_linear against what DenseLinear runs off the tiles
    (oneDNN; bf16 widened to float32 where the file says so), per dtype and row count (the median
    of the rounds, and the ratio round by round: median and range)."""
    machine = results["machine"]
    widened = results["workload"].get("bf16_widened", False)
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores; {results['rounds']} alternating rounds; "
        f"commit {machine['git_commit'][:7]}; `{results['command']}`",
        "\n| dtype | rows | off the tiles ms | tiles ms | tiles' GB/s | speed ratio, median (range) "
        "| DenseLinear takes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        untiled = "widened to float32" if widened and row["dtype"] == "bfloat16" else "oneDNN"
        lines.append(
            f"| {row['dtype']} | {row['rows']} | {row['onednn_ms']:.2f} | {row['tiles_ms']:.2f} | "
            f"{row['tiles_weight_gb_s']:.0f} | {row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | "
            f"{'tiles' if row['used'] else untiled} |"
        )
    return "\n".join(lines) + "\n"


def prompt_rows(results: dict[str, Any]) -> str:
    """Prompt-row projections: oneDNN's bf16 matmul, the bf16 weight widened to float32, and
    float32 weights on oneDNN, per row count (medians of the rounds; speed ratios against bf16's
    matmul round by round: median and range)."""
    machine = results["machine"]
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores; {results['rounds']} alternating rounds; "
        f"commit {machine['git_commit'][:7]}; `{results['command']}`",
        "\n| rows | bf16 matmul ms | bf16 widened ms | float32 ms | widened / bf16 matmul | float32 / bf16 matmul |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['rows']} | {row['bf16_onednn_ms']:.1f} | {row['bf16_widened_ms']:.1f} | "
            f"{row['float32_onednn_ms']:.1f} | {row['widened_vs_bf16']:.2f}x ({row['widened_min']:.2f}-"
            f"{row['widened_max']:.2f}) | {row['float32_vs_bf16']:.2f}x ({row['float32_min']:.2f}-"
            f"{row['float32_max']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def stored_rows(results: dict[str, Any]) -> str:
    """Q4_1 projections as stored (int16, widened and GroupedLinear's choice) against the float32
    model's, per row count: medians of the rounds, and the speed ratios round by round."""
    machine = results["machine"]
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores; {results['rounds']} alternating rounds; "
        f"commit {machine['git_commit'][:7]}; `{results['command']}`",
        "\n| rows | int16 ms | widened ms | float32 ms | takes | its speed / float32's, median (range) |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['rows']} | {row['int16_ms']:.1f} | {row['widened_ms']:.1f} | {row['float32_ms']:.1f} | "
            f"{row['chosen']} | {row['chosen_vs_float32']:.2f}x ({row['chosen_min']:.2f}-{row['chosen_max']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def kv_precision(results: dict[str, Any]) -> str:
    """A KV precision against the model's own: bytes, capacity, answers; decode step ratios by round."""
    machine, dtype, rows = results["machine"], results["args"].get("dtype", "float32"), results["rows"]
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores; a {dtype} model; commit {machine['git_commit'][:7]}; "
        f"`{results['command']}`\n\n| KV | bytes per token | 1,000-token requests in 256 MiB | greedy answers "
        f"equal to {dtype} KV's (of {len(results['prompts'])}; mean common prefix) |\n|---|---|---|---|",
        *(
            f"| {r['kv']} | {r['bytes_per_token']:,} | {r['requests_in_256_mib']} | {r['answers_equal']} "
            f"({r['mean_common_prefix']:.1f}) |"
            for r in rows
            if r["table"] == "capacity"
        ),
        f"\n| KV | requests x context | decode step, median | vs {dtype} KV, median (range) |\n|---|---|---|---|",
        *(
            f"| {r['kv']} | {r['requests']} x {r['context']:,} | {r['step_ms']:.1f} ms | "
            f"{r[f'vs_{dtype}']:.2f} ({r['vs_min']:.2f}-{r['vs_max']:.2f}) |"
            for r in rows
            if r["table"] == "decode"
        ),
    ]
    return "\n".join(lines) + "\n"


def attention_vs_vllm(results: dict[str, Any]) -> str:
    """vattn's attention kernel against vLLM's (its AMX one and its AVX-512 `vec`), per shape:
    milliseconds per pass over the layers, and vattn's speed relative to each, median (range)."""
    machine = results["machine"]
    lines = [
        f"{machine['cpu_model']}, {machine['nproc']} cores; commit {machine['git_commit'][:7]}; `{results['command']}`",
        "",
        "| batch x context x new tokens | vattn | vLLM AMX | vattn / vLLM AMX | vLLM AVX-512 | vattn / vLLM AVX-512 |",
        "|---|---|---|---|---|---|",
    ]
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for row in results["summary"]:
        by_shape.setdefault(row["shape"], {})[row["peer"]] = row
    for shape, peers in by_shape.items():
        amx, vec = peers["vllm-amx"], peers["vllm-vec"]
        lines.append(
            f"| {shape.replace('x', ' x ')} | {amx['vattn_ms']:.1f} | {amx['peer_ms']:.1f} | {amx['vattn_speed']:.2f}x "
            f"({amx['min']:.2f}-{amx['max']:.2f}) | {vec['peer_ms']:.1f} | {vec['vattn_speed']:.2f}x "
            f"({vec['min']:.2f}-{vec['max']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "few_rows": few_rows,
    "avx2/stored_rows": stored_rows,
    "avx2/few_rows": few_rows,
    "amx/few_rows": few_rows,
    "avx512_intel/few_rows": few_rows,
    "avx512_intel/prompt_rows": prompt_rows,
    "avx512_intel/quality": quality,
    "avx512_intel/offline_compare": offline_compare,
    "avx512_intel/offline_compare.ratios": offline_ratios,
    "avx512_intel/serving_compare_default": serving_compare,
    "avx512_intel/serving_compare_default.ratios": serving_ratios,
    "avx512_intel/serving_compare_q8": serving_compare,
    "zen5/quality": quality,
    "zen5/offline_compare": offline_compare,
    "zen5/offline_compare.ratios": offline_ratios,
    "zen5/serving_compare_default": serving_compare,
    "zen5/serving_compare_default.ratios": serving_ratios,
    "amx/attention_vs_vllm": attention_vs_vllm,
    "amx/offline_compare": offline_compare,
    "amx/offline_compare.ratios": offline_ratios,
    "amx/offline_compare_int8": offline_compare,
    "amx/offline_compare_kv8": offline_compare,
    "amx/quality": quality,
    "amx/kv_precision_bf16": kv_precision,
    "amx/serving_compare_default": serving_compare,
    "amx/serving_compare_default.ratios": serving_ratios,
    "quality_bf16": quality,
    "quality_kv_f16": quality,
    "offline_compare": offline_compare,
    "avx2/offline_compare": offline_compare,
    "avx2/offline_compare.ratios": offline_ratios,
    "avx2/offline_compare_default": offline_compare,
    "avx2/offline_compare_default.ratios": offline_ratios,
    "offline_compare.ratios": offline_ratios,
    "serving_compare_equal_precision.quality": equal_quality,
    "serving_compare": serving_compare,
    "avx2/serving_compare": serving_compare,
    "avx2/serving_compare.ratios": serving_ratios,
    "avx2/serving_compare_default": serving_compare,
    "avx2/serving_compare_default.ratios": serving_ratios,
    "serving_compare.ratios": serving_ratios,
    "serving_compare_default": serving_compare,
    "serving_compare_default.ratios": serving_ratios,
    "sleep_mode": sleep_mode,
    "shared_budget": shared_budget,
}


def generated(text: str) -> str:
    """`text` with every generated block rendered from its results file."""

    def render(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown generated table {name!r}; known: {', '.join(TABLES)}")
        results = json.loads((RESULTS_DIR / f"{name.split('.')[0]}.json").read_text())
        return match.group(1) + TABLES[name](results) + match.group(4)

    return BLOCK.sub(render, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    stale = []
    for readme in READMES:
        text = readme.read_text()
        for problem in unsourced(text):
            print(f"{readme.relative_to(REPO_ROOT)}, {problem}")
        new = generated(text)
        if new != text:
            stale.append(readme)
            if not args.check:
                readme.write_text(new)
    for readme in stale:
        print(f"{readme.relative_to(REPO_ROOT)}: {'stale' if args.check else 'rewritten'}")
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()

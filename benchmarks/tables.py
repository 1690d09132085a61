"""The READMEs' result tables, generated from the committed results files, never typed.

    python -m benchmarks.tables           # rewrites every generated table in place
    python -m benchmarks.tables --check   # exit status 1 if a table differs from its results file

A generated table sits between `<!-- generated: NAME -->` and `<!-- end generated -->` in
README.md or benchmarks/README.md; NAME is one of TABLES, each a function of its results file
(benchmarks/results/NAME.json; NAME.PART is another table of the same file).
tests/test_tables.py runs the check, so a README figure that is not its results file's fails
the tests.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.offline_compare import comparisons, round_speeds
from measure.results import REPO_ROOT, RESULTS_DIR

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
        f"{machine['cpu_model']}, commit {machine['git_commit'][:7]}; `{results['command']}`",
        "",
        "| system | preset | perplexity | vs its float | same top-1 |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        change = f"{row['perplexity_change']:+.2%}" if row["perplexity_change"] else ""
        agreement = f"{row['top1_agreement']:.2%}" if row["top1_agreement"] != 1.0 else ""
        lines.append(f"| {row['system']} | {row['preset']} | {row['perplexity']:.4f} | {change} | {agreement} |")
    return "\n".join(lines) + "\n"


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "quality_bf16": quality,
    "offline_compare": offline_compare,
    "offline_compare.ratios": offline_ratios,
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

"""`python -m paper_repro [NAME ...] [--quick]`: runs the named experiments (all by default)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from tqdm import tqdm

EXPERIMENTS = ("prefill", "decode", "allocation", "latency_hiding", "optimizations", "fragmentation")
"""Module names under paper_repro, in the paper's order of tables and figures."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m paper_repro", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(EXPERIMENTS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that each experiment runs")
    parser.add_argument("--out", help="results folder (default: paper_repro/results/<device>)")
    args = parser.parse_args(argv)
    names = args.names or list(EXPERIMENTS)
    if unknown := [name for name in names if name not in EXPERIMENTS]:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(EXPERIMENTS)}")
    for name in tqdm(names, desc="experiments", disable=len(names) == 1):
        options = (["--quick"] if args.quick else []) + (["--out", args.out] if args.out else [])
        importlib.import_module(f"paper_repro.{name}").main(options)


if __name__ == "__main__":
    main()

"""`python -m paper_repro [NAME ...] [--quick]`: runs the named experiments (all by default)."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
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
    options = (["--quick"] if args.quick else []) + (["--out", args.out] if args.out else [])
    failed: dict[str, int] = {}
    for name in tqdm(names, desc="experiments", disable=len(names) == 1):
        if status := run_experiment(name, options):
            failed[name] = status
    if failed:  # after every experiment ran: the status of the one that failed, else 1
        print(
            "\nnot completed: " + ", ".join(f"{name} (exit {code})" for name, code in failed.items()), file=sys.stderr
        )
        raise SystemExit(next(iter(failed.values())) if len(failed) == 1 else 1)


def run_experiment(name: str, options: list[str]) -> int:
    """Runs one experiment and returns its exit status (0 when it returned), so that one that
    fails (after writing what it measured) does not stop the ones after it."""
    try:
        importlib.import_module(f"paper_repro.{name}").main(options)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # SystemExit("message"): printed, status 1
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    main()

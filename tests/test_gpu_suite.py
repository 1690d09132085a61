"""benchmarks/gpu_suite.sh, the one prepared GPU run, run through here on the fakes (FAKE_GPU=1).

A lent GPU gives 15 minutes all told, 10 a command, 8 files back: the suite must get through
every step inside its budget, cut a step short rather than overrun it, and hand back its
summary and tarball alone. The GPU steps run on tests/fake_gpu.py (fake CUDA tensors, the fake
driver); those that need the device's values are stubbed and say so. The two whole runs take
~90 s: `make gpu-wheels` (VATTN_GPU_SUITE=1) runs them, `make test` the quick checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from benchmarks.gpu_probe import untested

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "build",
    "versions",
    "gpu",
    "kernels",
    "sdpa",
    "model",
    "serve",
    "cuda",
    "decode",
    "prefill",
    "host_ops",
    "host_rows",
    "host_offline",
    "fake",
    "allocation",
]


def run_suite(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]], float]:
    """The suite's exit, its summary's lines split into (step, seconds, status...), its seconds."""
    out, send = tmp_path / "out", tmp_path / "send"
    environment = os.environ | {"OUT": str(out), "SEND": str(send), "PYTHON": sys.executable}
    environment |= {"WHEELS": str(tmp_path / "no-wheels")} | env  # this venv has what they hold
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600
    )
    seconds = time.monotonic() - started
    summary = [line.split() for line in (send / "summary.txt").read_text().splitlines()]
    assert sorted(p.name for p in send.iterdir()) == ["gpu_results.tgz", "summary.txt"], "only these come back"
    return done, summary, seconds


WHOLE_RUNS = pytest.mark.skipif(
    os.environ.get("VATTN_GPU_SUITE") != "1",
    reason="a whole run of the suite on the fakes (~90 s): `make gpu-wheels` runs it, before a lent GPU",
)


@WHOLE_RUNS
def test_the_whole_suite_runs_through_on_the_fakes_inside_its_budget(tmp_path: Path) -> None:
    done, summary, seconds = run_suite(tmp_path, FAKE_GPU="1", SUITE_SECONDS="400")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    steps = {line[0]: " ".join(line[2:]) for line in summary}
    assert [line[0] for line in summary][: len(STEPS)] == STEPS
    for step in ("build", "versions", "kernels", "decode", "prefill"):
        assert steps[step] == "ok", (step, steps[step])
    assert steps["gpu"].startswith("gpu fake GPU")
    assert steps["model"].startswith("stubbed (FAKE_GPU)")
    assert steps["sdpa"].startswith("stubbed (FAKE_GPU)")
    assert seconds < 400 and int(summary[-1][1].rstrip("s")) < 400

    probes = {(p["kernel"], p["dtype"]): p for p in map(json.loads, (tmp_path / "out/kernels.jsonl").open())}
    for kernel in ("torch_flash_attn", "paged_torch_flash_attn"):  # built, planned and run on fake CUDA tensors
        for dtype in ("bfloat16", "float16"):
            assert probes[kernel, dtype]["status"] == "available", probes[kernel, dtype]
    for kernel in ("flash_attn", "flashinfer_paged", "paged_flashinfer"):  # not installed here
        assert probes[kernel, "bfloat16"]["status"] == "unavailable"

    decode = json.loads((tmp_path / "out/results/fake-gpu/decode.json").read_text())["rows"]
    ran = {row["variant"] for row in decode if row["status"] == "ok"}
    assert {"virtual/torch_flash_attn", "paged256/paged_torch_flash_attn"} <= ran
    with tarfile.open(tmp_path / "send/gpu_results.tgz") as tarball:
        names = tarball.getnames()
    assert "./summary.txt" in names and "./kernels.jsonl" in names and "./results/fake-gpu/decode.json" in names


@WHOLE_RUNS
def test_a_step_the_budget_cannot_hold_is_skipped_and_the_suite_still_packs_up(tmp_path: Path) -> None:
    done, summary, seconds = run_suite(tmp_path, FAKE_GPU="1", SUITE_SECONDS="30")
    assert done.returncode == 0, done.stdout[-4000:]
    skipped = [line[0] for line in summary if " ".join(line[2:]).startswith("skipped: out of time")]
    assert {"decode", "prefill"} <= set(skipped)
    assert seconds < 30 + 5  # the last packing step may end a moment past the budget's edge


def test_without_a_gpu_the_suite_stops_after_the_versions(tmp_path: Path) -> None:
    done, summary, _ = run_suite(tmp_path, SUITE_SECONDS="120")
    assert done.returncode == 0, done.stdout[-4000:]
    steps = [line[0] for line in summary]
    assert steps == ["build", "versions", "gpu", "total"]
    assert " ".join(summary[2][2:]).startswith("none: stopped here (no GPU")


@pytest.mark.parametrize(
    ("cases", "expected"),
    [
        ({"test_kernels_match_reference[bfloat16-mega-torch_flash_attn]": False}, []),
        ({"test_kernels_match_reference[bfloat16-mega-torch_flash_attn]": True}, ["torch_flash_attn bfloat16"]),
        ({"test_kernels_match_reference[float16-mega-torch_flash_attn]": False}, ["torch_flash_attn bfloat16"]),
        (
            {
                "test_kernels_match_reference[bfloat16-mega-torch_flash_attn]": True,
                "test_kernels_match_reference[bfloat16-per_layer-torch_flash_attn]": False,
            },
            [],
        ),
    ],
)
def test_an_available_kernel_whose_tests_all_skip_is_untested(cases: dict[str, bool], expected: list[str]) -> None:
    """`cases`: test name -> skipped. The probe found torch_flash_attn available in bfloat16 and
    flash_attn unavailable, whose skips are expected."""
    suite = ElementTree.Element("testsuite")
    for name, skipped in cases.items():
        case = ElementTree.SubElement(suite, "testcase", name=name)
        if skipped:
            ElementTree.SubElement(case, "skipped")
    flash_skip = ElementTree.SubElement(
        suite, "testcase", name="test_kernels_match_reference[bfloat16-mega-flash_attn]"
    )
    ElementTree.SubElement(flash_skip, "skipped")
    probes = [
        {"kernel": "torch_flash_attn", "dtype": "bfloat16", "status": "available"},
        {"kernel": "flash_attn", "dtype": "bfloat16", "status": "unavailable"},
    ]
    assert untested(probes, suite) == expected

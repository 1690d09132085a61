"""The fake CUDA driver catches real mistakes: each deliberately broken backend
(tests/fake_cuda/breakages.py), on the Python call path and on the C library's, makes the
tests that run on the fake fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "tests.fake_cuda.breakages"]

CASES = {
    "misaligned-map": ("tests/test_kv_cache.py", "test_data_survives and ctypes-fakecuda", "CUDA_ERROR_INVALID_VALUE"),
    "no-set-access": (
        "tests/test_kv_cache.py",
        "test_data_survives and ctypes-fakecuda",
        "is not mapped device memory",
    ),
    "leaked-handle": ("tests/test_kv_cache.py", "test_data_survives and ctypes-fakecuda", "left behind: {'handles'"),
    "no-context": ("tests/test_kv_cache.py", "test_background_thread_maps_ahead and ctypes-fakecuda", "mapper failed"),
    "no-rollback": ("tests/test_cuda_fake.py", "halfway and ctypes-cuMemMap", "mapping page 0 of"),
    "unfenced-unmap": (
        "tests/test_cuda_fake.py",
        "waits_for_the_queued_work and ctypes-release_idle",
        "while queued GPU work reads it",
    ),
    # the same mistakes in the C library's calls (native/vattn_native.c)
    "c-misaligned-map": (
        "tests/test_kv_cache.py",
        "test_data_survives and native-fakecuda",
        "CUDA_ERROR_INVALID_VALUE",
    ),
    "c-no-set-access": (
        "tests/test_kv_cache.py",
        "test_data_survives and native-fakecuda",
        "is not mapped device memory",
    ),
    "c-unfenced-unmap": (
        "tests/test_cuda_fake.py",
        "waits_for_the_queued_work and native-release_idle",
        "while queued GPU work reads it",
    ),
}
"""Breakage -> (tests, their selection, what the failure says)."""


@pytest.mark.parametrize("breakage", list(CASES))
def test_a_broken_backend_fails_the_tests_on_the_fake_driver(breakage: str) -> None:
    path, selection, symptom = CASES[breakage]
    run = subprocess.run(
        [*PYTEST, path, "-k", selection],
        cwd=ROOT,
        env={**os.environ, "VATTN_BREAK": breakage, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # 3 s a run on 2 cores
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 1, output[-3000:]
    assert " failed" in output or " error" in output, output[-3000:]
    assert symptom in output, output[-3000:]

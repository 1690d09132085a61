"""Hypothesis profiles: `make test` draws the same cases every run; `make fuzz` draws new ones.

In `make test` (the default `ci` profile) every property test and the schemathesis fuzz are
derandomized (cases follow from each test's name) and keep no example database, so a
commit's result never depends on luck. `make fuzz` sets VATTN_FUZZ=1: random seeds and
FUZZ_SCALE times the examples. A case it finds becomes a fixed regression test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZING = os.environ.get("VATTN_FUZZ") == "1"
FUZZ_SCALE = 20


def register_profiles() -> None:
    common = {"deadline": None, "suppress_health_check": list(HealthCheck), "database": None}
    settings.register_profile("ci", derandomize=True, **common)
    settings.register_profile("fuzz", derandomize=False, print_blob=True, max_examples=100 * FUZZ_SCALE, **common)
    settings.load_profile("fuzz" if FUZZING else "ci")


def examples(count: int) -> int:
    """`count` examples in `make test`, FUZZ_SCALE times as many in `make fuzz`."""
    return count * FUZZ_SCALE if FUZZING else count

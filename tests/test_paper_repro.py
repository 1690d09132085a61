"""Every paper_repro experiment runs end to end at its `--quick` size (so none can rot)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from paper_repro import decode
from paper_repro.__main__ import EXPERIMENTS, main
from paper_repro._harness import Variant
from serving import LLM


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_runs_quick_and_writes_its_results(name: str, tmp_path: Path) -> None:
    main([name, "--quick", "--out", str(tmp_path)])
    for ext in ("csv", "json", "png"):
        assert (tmp_path / f"{name}.{ext}").stat().st_size > 0
    with (tmp_path / f"{name}.csv").open() as rows:
        assert len(list(csv.DictReader(rows))) >= 2


def test_an_unknown_experiment_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["table9"])
    assert "unknown experiment" in capsys.readouterr().err


def test_a_variant_that_fails_while_measured_costs_only_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    measure = decode.decode_step_seconds

    def failing_at_batch_2_on_ragged(llm: LLM, batch: int, context: int, steps: int) -> float:
        if batch == 2 and llm.engine.config.kernel == "ragged":
            raise RuntimeError("a kernel fault in the middle of the run")
        return measure(llm, batch, context, steps)

    monkeypatch.setattr(decode, "decode_step_seconds", failing_at_batch_2_on_ragged)
    variants = [Variant("virtual", "ragged"), Variant("virtual", "no_such_kernel"), Variant("paged", "paged", 16)]
    rows = decode.model_rows(variants, batches=[1, 2], context=32, steps=2, model=None)
    assert {(r["variant"], r["batch"]): r["status"] for r in rows} == {
        ("virtual/ragged", 1): "ok",
        ("virtual/ragged", 2): "failed",
        ("virtual/no_such_kernel", 1): "failed",
        ("virtual/no_such_kernel", 2): "failed",
        ("paged16/paged", 1): "ok",
        ("paged16/paged", 2): "ok",
    }

"""Every paper_repro experiment runs end to end at its `--quick` size (so none can rot)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from paper_repro.__main__ import EXPERIMENTS, main


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

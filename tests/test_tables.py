"""The READMEs' generated tables are what their results files say (benchmarks/tables.py)."""

from __future__ import annotations

from benchmarks.tables import BLOCK, READMES, TABLES, generated


def test_every_generated_table_is_its_results_files() -> None:
    for readme in READMES:
        text = readme.read_text()
        assert generated(text) == text, f"{readme.name}: run python -m benchmarks.tables"


def test_the_readmes_hold_every_generated_table() -> None:
    names = {match.group(2) for readme in READMES for match in BLOCK.finditer(readme.read_text())}
    assert names == set(TABLES)

"""The READMEs' generated tables are what their results files say (benchmarks/tables.py)."""

from __future__ import annotations

from benchmarks.figures import unsourced
from benchmarks.tables import BLOCK, READMES, TABLES, generated


def test_every_generated_table_is_its_results_files() -> None:
    for readme in READMES:
        text = readme.read_text()
        assert generated(text) == text, f"{readme.name}: run python -m benchmarks.tables"


def test_the_readmes_hold_every_generated_table() -> None:
    names = {match.group(2) for readme in READMES for match in BLOCK.finditer(readme.read_text())}
    assert names == set(TABLES)


def test_every_typed_table_figure_is_in_a_results_file_it_cites() -> None:
    for readme in READMES:
        assert unsourced(readme.read_text()) == [], f"{readme.name}: python -m benchmarks.tables --check"


def test_a_figure_in_no_cited_file_and_a_table_citing_none_are_found() -> None:
    """The check bites: a figure the cited file lacks, and a table of figures with no citation."""
    cited = "Quality (`results/quality.*`):\n\n| system | perplexity |\n|---|---|\n| vattn | 15.0699 |\n"
    assert unsourced(cited) == []
    assert unsourced(cited.replace("15.0699", "15.0698")) == ["line 3: 15.0698 in none of quality"]
    uncited = cited.replace("Quality (`results/quality.*`):", "Quality:")
    assert unsourced(uncited) == ["line 3: a table of figures that cites no results file"]

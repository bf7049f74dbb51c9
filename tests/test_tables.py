"""Tables in a narrow terminal: cells wrap between words, not inside them."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from cli.tables import fit_words


def render(table, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width)
    console.print(table)
    return console.file.getvalue().splitlines()


def stage_like() -> Table:
    table = Table(title="Pipelines")
    for column in ("pipes", "stage", "layers", "device", "tp", "micro batches", "recompute",
                   "ZeRO", "memory"):
        table.add_column(column, overflow="fold")
    table.add_row("16", "0", "embedding .. layers.18", "A100-80G-SXM", "1", "32x16 of 1",
                  "selective", "2", "58.1/80 GiB")
    table.add_row("", "2", "layers.26 .. head", "V100-32G", "1", "", "none", "2", "18/32 GiB")
    return table


def test_words_stay_whole_where_the_longest_fit():
    lines = render(fit_words(stage_like()), 80)
    assert max(map(len, lines)) <= 80
    words = {w for line in lines for w in line.split()}
    for word in ("embedding", "layers.18", "A100-80G-SXM", "selective", "58.1/80", "GiB",
                 "recompute"):
        assert word in words, (word, lines)
    # plain rich folds inside words at the same width
    assert "A100-80G-SXM" not in {w for line in render(stage_like(), 80) for w in line.split()}


def test_wide_enough_keeps_one_line_per_row():
    lines = render(fit_words(stage_like()), 200)
    assert any("embedding .. layers.18" in line and "58.1/80 GiB" in line for line in lines)


def test_words_too_long_fold_the_widest_column_first():
    table = Table()
    table.add_column("row")
    table.add_column("a")
    table.add_column("b")
    table.add_row("min memory headroom", "/" + "x" * 70, "/" + "y" * 70)
    lines = render(fit_words(table), 80)
    assert max(map(len, lines)) <= 80
    assert any("min memory headroom" in line for line in lines)

"""Tables and panels that read well in a narrow terminal, and a command's output console,
which does not wrap them at 80 columns where the output is a file or a pipe."""

from __future__ import annotations

import copy
import os

from rich.console import Console, ConsoleDimensions, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.table import Table

# Columns of output written to a file or a pipe: the widest table a plan's commands print
# (the baselines' with their descriptions, a 16,000-GPU plan's device map) fits in 200.
PIPED_WIDTH = 200


class OutputConsole(Console):
    """A command's stdout: on a terminal as wide as the terminal; written to a file or a
    pipe as wide as PIPED_WIDTH, not rich's 80 columns there, so that each table row stays
    one line for grep, diff and `less -S` (COLUMNS, where set, still decides)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        columns = os.environ.get("COLUMNS", "")
        if self.is_terminal or self._width is not None or columns.isdigit():
            return size
        return ConsoleDimensions(PIPED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def output_console() -> OutputConsole:
    return OutputConsole(emoji=False)


class FitPanel(Panel):
    """A panel across the terminal, or as wide as its text where the output is not a
    terminal (else it would stretch to the wide console of a file or a pipe)."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if console.is_terminal or not self.expand:
            yield from super().__rich_console__(console, options)
            return
        fitted = copy.copy(self)
        fitted.expand = False
        yield fitted


def counted(count: int, noun: str) -> str:
    """`1 device`, `48 devices`."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


class FitWords:
    """A table without rules (its padding between columns, bold headers) whose columns
    are narrowed, widest first, down to their longest word, so cells wrap between
    words rather than inside them (rich alone narrows every column in proportion); where
    the longest words do not fit either, the widest columns are folded first. Cells are
    text as written, never markup: names in them (nodes, device types, files) may hold
    [..] or :name:."""

    def __init__(self, table: Table) -> None:
        table.box, table.pad_edge = None, False
        self.table = table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = self.table.columns
        texts = [[str(c) for c in [column.header, *column.cells]] for column in columns]
        least = [max((len(w) for t in cells for w in t.split()), default=1) for cells in texts]
        widths = [max((len(line) for t in cells for line in t.splitlines()), default=1)
                  for cells in texts]
        _, right, _, left = self.table.padding
        gap = max(right, left) if self.table.collapse_padding else right + left
        room = options.max_width - gap * (len(columns) - 1)
        if sum(least) > room:  # even the longest words do not fit: fold the widest
            least = [min(4, w) for w in widths]
        while sum(widths) > room:
            wider = [i for i in range(len(widths)) if widths[i] > least[i]]
            if not wider:
                break
            widest = max(wider, key=lambda i: (widths[i], -i))
            widths[widest] -= 1
        for column, width in zip(columns, widths, strict=True):
            column.width = width
        yield from console.render(self.table, options.update(markup=False))


def fit_words(table: Table) -> FitWords:
    return FitWords(table)

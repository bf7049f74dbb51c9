"""Tables that read well in a narrow terminal (80 columns when output is piped)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table


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

"""Where a long solve stands, on stderr: the time it has run against its limit, the best
plan so far and how far from optimal it may be. On a terminal a status line that rich
redraws (its clock ticks between the solver's reports); where stderr is a file or a pipe,
where rich's status prints nothing, a line every few seconds from a heartbeat thread (the
solver reports nothing while it builds its tables or prices its first plans, at 16,000
GPUs for longer than the time limit), and a last line at the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from planner.solver import Progress
    from planner.types import Plan

PIPED_EVERY = 5.0  # seconds between two lines where stderr is not a terminal
HEARTBEAT = 1.0  # seconds between two looks at the clock for a line that is due
ENDED = {"optimal": "done", "feasible": "stopped at the time limit",
         "interrupted": "stopped by Ctrl-C"}  # a search's status, as its last line says it


@dataclass
class SolveProgress:
    """The solver's progress callback (`planner.solver.solve(progress=...)`; `update`
    takes `Progress.describe()`'s text where a caller hands on only that) and the lines
    it makes. `clock` is read for the time shown and for when a line is due, so that a
    test can drive it."""

    console: Console  # stderr
    limit: float | None  # the search's time limit (seconds)
    clock: Callable[[], float] = time.monotonic
    every: float = PIPED_EVERY
    message: str = "Searching plans..."  # the solver's latest report
    start: float = field(init=False)
    printed: float = field(init=False)  # when the last line was printed

    def __post_init__(self) -> None:
        self.start = self.printed = self.clock()

    def __call__(self, now: Progress) -> None:
        self.update(now.describe())

    def update(self, message: str) -> None:
        """A report from the solver, for the next line or redraw."""
        self.message = message

    def tick(self) -> None:
        """Print the line if `every` seconds have passed since the last one (the heartbeat
        calls it where stderr is not a terminal)."""
        if self.clock() - self.printed >= self.every:
            self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)
            self.printed = self.clock()

    def line(self) -> str:
        """`[12 s of the 60 s limit] Searching plans: 1,234 explored, best 23.8 s step, at
        most 0.5% from optimal (Ctrl-C stops with it)`."""
        return f"[{self._elapsed()}] {self.message}"

    def finish(self, plan: Plan) -> None:
        """The last line, where stderr is not a terminal (on one, the plan's solver
        report says the same on stdout): how the search ended, its best plan and gap."""
        if self.console.is_terminal:
            return
        from planner.units import fmt_seconds

        report = plan.solver
        self.console.print(
            f"[{self._elapsed()}] Search {ENDED.get(report.status, report.status)}: best "
            f"{fmt_seconds(report.objective)} step, at most {report.gap:.1%} from optimal, "
            f"{report.explored:,} explored.", markup=False, highlight=False, soft_wrap=True)

    def _elapsed(self) -> str:
        seconds = self.clock() - self.start
        elapsed = f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
        return f"{elapsed}, no time limit" if self.limit is None else (
            f"{elapsed} of the {self.limit:g} s limit")

    def __rich__(self) -> Text:  # what the terminal's status line shows at each redraw
        return Text(self.line())


@contextmanager
def solve_progress(console: Console, limit: float | None) -> Iterator[SolveProgress]:
    """A `SolveProgress` for the solve run inside: on a terminal under a rich status,
    elsewhere with a heartbeat thread that prints its line every `every` seconds."""
    progress = SolveProgress(console, limit)
    if console.is_terminal:
        with console.status(progress, spinner="dots"):
            yield progress
        return
    stop = threading.Event()
    heartbeat = threading.Thread(target=_beat, args=(progress, stop), daemon=True)
    heartbeat.start()
    try:
        yield progress
    finally:
        stop.set()
        heartbeat.join()


def _beat(progress: SolveProgress, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT):
        progress.tick()

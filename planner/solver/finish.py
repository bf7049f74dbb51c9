"""When a (partial) structure's micro-batches can be done at the earliest: `Bound`'s walk
in time (`earliest`), over what its pipelines finish by each time (`Finished`).

A pipeline whose first micro-batch takes `total` and every next one at least `period`
finishes at most 1 + floor((t - total) / period) micro-batches by time t (`done_by`;
none before `total`; without the floor, run fluidly, to find where to start). A fixed
class finishes n c(t), c the largest such count over its (period, fill) pairs
(`FixedLines`). The open levels add what their classes can on the devices left
(`OpenValue`): a homogeneous level whole pipelines of its best family on its type's
slots (`WholeLevels`), or every open level its slots' worth at per-slot values that
cover each of its families (an LP dual: `SlotValues`), where a mixed level is open.
The bound is the first time the fixed classes and the open levels make up the global
batch: found fluidly (`first_enough`), then walked on to the next time a fixed pipeline
completes one while even the open levels' count by then falls short, and within that
last interval, where the fixed count stays put, to where the open levels make up the
rest (`catch_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.solver.partition import INF


@dataclass(frozen=True)
class LevelView:
    """A level's families side by side, as `Bound` values them (`Bound._level`)."""

    counts: np.ndarray  # [family, type]: devices of each type one pipeline takes
    inv_size: np.ndarray  # 1 / devices one pipeline takes
    holding: list[np.ndarray]  # per type, the families that use it
    inv_fluid: np.ndarray  # 1 / sum_k counts_k / W_k (W_k: `device_work`)
    home: int  # the level's own type (-1: a level of mixed patterns)
    inv_busy: np.ndarray  # 1 / min_busy (0 for a family that cannot run)
    total: np.ndarray  # its fill floor (infinite for a family that cannot run)


@dataclass(frozen=True)
class OpenLevels:
    """The open homogeneous levels' families side by side (`Bound._homogeneous`)."""

    homes: np.ndarray  # each level's type
    starts: np.ndarray  # where each level's families start
    inv_size: np.ndarray  # per family, as `LevelView`
    inv_busy: np.ndarray
    total: np.ndarray


def done_by(t: np.ndarray, total: np.ndarray, inv_busy: np.ndarray, whole: bool
            ) -> np.ndarray:
    """Micro-batches a pipeline whose first takes `total` and every next one at least
    1 / inv_busy can have finished by time t (whole ones if `whole`, else run fluidly)."""
    done = 1 + (t - total) * inv_busy  # (t - inf) * 0 where it cannot run: nan, dropped
    return np.where(t >= total, np.floor(done + 1e-9) if whole else done, 0.0)


def floors_after(pairs: tuple[tuple[float, float], ...], t: float
                 ) -> tuple[tuple[float, float], ...]:
    """Of a class's (period, fill) pairs, the first and those whose line (micro-batches
    finished by a time) lies above the first's somewhere after t: the first's has the
    shortest period, so past their crossing it finishes more."""
    if len(pairs) == 1:  # (most families': their first bounds alone)
        return pairs
    (least, fill), *rest = pairs
    return (pairs[0], *((p, f) for p, f in rest
                        if (f / p - fill / least) / (1 / p - 1 / least) > t))


@dataclass(frozen=True)
class FixedLines:
    """The fixed classes and each row's candidate class: a row per class (the fixed ones,
    then the candidates'), a column per candidate, and per pair of its floors
    (`Family.floors` that can matter after some time: `floors_after`, the last repeated
    to one width)."""

    pipes: np.ndarray  # [class, row]: pipelines (0: no class)
    periods: np.ndarray  # [class, row, pair]
    fills: np.ndarray  # [class, row, pair]
    inv_busy: np.ndarray  # 1 / periods

    @classmethod
    def of(cls, fixed: list[tuple[float, list[tuple[tuple[float, float], ...]]]],
           candidates: list[tuple[float, tuple[tuple[float, float], ...]]]) -> FixedLines:
        """From (pipelines, pairs per row) of each fixed class and (pipelines, pairs) of
        each row's candidate (a row's pairs those that can matter to it alone, so that a
        row is bounded as in a call of its own)."""
        rows = len(candidates)
        pairs = [p for _, per_row in fixed for p in per_row] + [p for _, p in candidates]
        width = max(map(len, pairs))
        grid = np.array([list(p) + [p[-1]] * (width - len(p)) for p in pairs]).reshape(
            len(fixed) + 1, rows, width, 2)
        pipes = np.array([np.full(rows, float(n)) for n, _ in fixed]
                         + [np.array([n for n, _ in candidates], dtype=float)])
        return cls(pipes, grid[..., 0], grid[..., 1], 1 / grid[..., 0])

    @property
    def width(self) -> int:
        """Pairs per class."""
        return self.periods.shape[2]

    def done(self, t: np.ndarray, whole: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per class and row, and per row in all, what the classes finish by t."""
        live = self.pipes > 0
        ones = np.where(live, done_by(t[:, None], self.fills, self.inv_busy, whole).max(axis=2),
                        0.0)
        return ones, (self.pipes * ones).sum(axis=0)

    def line_times(self, start: np.ndarray, m: float) -> np.ndarray:
        """Where every pipeline is busy from `start` on: the time the m micro-batches take
        on the pairs' least period and fill, run fluidly (a line in t; nan for a class
        that cannot run)."""
        live = self.pipes > 0
        least, fluid = self.periods[..., 0], self.fills[..., -1]
        rate = np.where(live, self.pipes / least, 0.0).sum(axis=0)
        offset = np.where(live, self.pipes * (1 - fluid / least), 0.0).sum(axis=0)
        return np.where(rate > 0, np.maximum(start, (m - offset) / rate), INF)

    def next_completion(self, times: np.ndarray) -> np.ndarray:
        """Per row, the first time after `times` a fixed pipeline completes a micro-batch
        on some pair's line."""
        usable = (self.pipes > 0)[..., None] & np.isfinite(self.periods)
        now = times[:, None]
        busy, total = self.periods, self.fills
        k = np.floor((now - total) / busy + 1e-9)
        step = total + (k + 1) * busy
        # far out (huge batches) rounding can put the next completion at `times`
        step = np.where(step > now, step, step + busy)
        return np.where(usable, np.where(now >= total, step, total), INF).min(axis=(0, 2))


@dataclass(frozen=True)
class WholeLevels:
    """Per open homogeneous level (a column; a row per t), the most micro-batches it can
    finish by t, and the most per slot of its type: at most the best of its families'
    whole pipelines that fit, each starting when it may (`Bound._whole_levels`)."""

    pipes: np.ndarray  # [row, family, rung]: pipelines of each rung of counts
    begins: np.ndarray  # broadcast to pipes: when the rung's first micro-batch is done
    pace: np.ndarray  # broadcast to pipes: 1 / its period
    starts: np.ndarray  # where each level's families start
    inv_size: np.ndarray  # per family: 1 / devices one pipeline takes
    homes: np.ndarray  # each level's type

    def done(self, t: np.ndarray, whole: bool, per_slot: bool = False
             ) -> tuple[np.ndarray, np.ndarray | None]:
        """Per level, and (if `per_slot`) per slot of its type."""
        if not self.pipes.shape[1]:
            empty = np.zeros((len(t), 0))
            return empty, empty if per_slot else None
        ends = done_by(t[:, None, None], self.begins, self.pace, whole)
        return (np.maximum.reduceat((self.pipes * ends).max(axis=2), self.starts, axis=1),
                np.maximum.reduceat(ends[:, :, 0] * self.inv_size, self.starts, axis=1)
                if per_slot else None)


@dataclass(frozen=True)
class SlotValues:
    """Per-slot values y (one row per t) that cover every open family at time t, and
    what the open levels finish beyond their slots' worth at y (see `Bound`): the open
    homogeneous levels' best per slot on their types, raised by the mixed families'
    (`mixed`: the families an open mixed level may add, `classes` such levels); four
    such y, the smallest result kept."""

    homogeneous: OpenLevels
    delay: np.ndarray | float  # [row, family]: how much later a homogeneous one may start
    mixed: LevelView | None
    classes: int  # open mixed levels
    room: np.ndarray | None  # [row, mixed family]: the most of its pipelines that fit
    work: np.ndarray  # per type, W_k (`families.device_work`)
    kinds: int

    def at(self, t: np.ndarray, whole: bool
           ) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray | float]]:
        """(y, where it is valid (None: everywhere), what the levels finish beyond their
        slots' worth at y)."""
        y = np.zeros((len(t), self.kinds))
        opened = self.homogeneous
        if len(opened.homes):
            per_slot = done_by(t[:, None], opened.total + self.delay, opened.inv_busy,
                               whole) * opened.inv_size
            y[:, opened.homes] = np.maximum.reduceat(per_slot, opened.starts, axis=1)
        view = self.mixed
        if view is None or not len(view.counts):
            return [(y, None, 0.0)]
        done = done_by(t[:, None], view.total, view.inv_busy, whole)
        per_slot = done * view.inv_size
        raised = np.maximum(y, np.stack([
            per_slot[:, held].max(axis=1) if len(held) else np.zeros(len(t))
            for held in view.holding], axis=1))
        # t / W_k per slot covers every family, tightened or not (see `families`); scaled
        # down to what the best mixed family reaches of it
        fluid = (done * view.inv_fluid).max(axis=1)[:, None] / self.work[None, :]
        covered = y.dot(view.counts.T)
        live = done > 0
        scale = np.where(live, done / covered, 0.0).max(axis=1)
        valid = ~(live & (covered <= 0)).any(axis=1)
        # or y left as it is: each mixed class holds at most the pipelines that fit,
        # each finishing what its slots are worth at y plus what it exceeds that by
        beyond = self.classes * (self.room * np.maximum(0.0, done - covered)).max(axis=1)
        return [(raised, None, 0.0), (np.maximum(y, fluid), None, 0.0),
                (y * np.where(valid, np.maximum(1.0, scale), 1.0)[:, None], valid, 0.0),
                (y, None, beyond)]


@dataclass(frozen=True)
class OpenValue:
    """What the open levels add to the micro-batches the fixed classes finish: the
    homogeneous levels of `counted` by whole pipelines (`whole`), every other open
    level at per-slot values on the devices left of the other types (`slots`). The two
    value disjoint sets of devices: where a mixed level is open, `counted` holds the
    levels of the types no open mixed family may use (`Bound._excluded`), which then
    hold every type of each row's candidate (so the pipelines it may drop leave
    devices to one of the two parts only)."""

    whole: WholeLevels | None
    counted: np.ndarray  # per level of `whole`: valued there
    slots: SlotValues | None
    free: np.ndarray  # [row, type]: devices the fixed classes and the candidate leave
    slot_kinds: np.ndarray  # per type: whether `slots` values its devices
    counts: np.ndarray  # [row, type]: devices one pipeline of the row's candidate takes
    spare: np.ndarray  # [row]: pipelines the candidate may drop

    def add(self, dropped: np.ndarray, value: np.ndarray, t: np.ndarray, whole: bool
            ) -> np.ndarray:
        """`value` plus what the open levels finish by t; `dropped`: what one of the
        candidate's pipelines finishes by then (its dropped pipelines' slots go to the
        open levels instead)."""
        dropping = bool(self.spare.any())
        if self.whole is not None and self.counted.any():
            value = value + self._whole_part(dropped, t, whole, dropping)
        if self.slots is None:
            return value
        best = np.full(len(t), INF)
        for y, valid, beyond in self.slots.at(t, whole):
            more = value + (self.free * self.slot_kinds * y).sum(axis=1) + beyond
            if dropping:
                freed = (self.counts * self.slot_kinds * y).sum(axis=1)
                more = np.maximum(more, more + self.spare * (freed - dropped))
            best = np.minimum(best, more if valid is None else np.where(valid, more, INF))
        return best

    def _whole_part(self, dropped: np.ndarray, t: np.ndarray, whole: bool, dropping: bool
                    ) -> np.ndarray:
        levels, per_slot = self.whole.done(t, whole, dropping)
        counted = self.counted
        if not dropping:
            return levels[:, counted].sum(axis=1)
        # the levels of the types the last class uses, per slot at either end
        homes = self.whole.homes[counted]
        levels, per_slot = levels[:, counted], per_slot[:, counted]
        touched = (self.counts[:, homes] > 0) & (self.spare > 0)[:, None]
        slots = self.free[:, homes] * per_slot
        freed = (self.counts[:, homes] * per_slot).sum(axis=1)
        linear = np.where(touched, slots, 0.0).sum(axis=1)
        return (np.where(touched, 0.0, levels).sum(axis=1) + linear
                + np.maximum(0.0, self.spare * (freed - dropped)))


@dataclass(frozen=True)
class Finished:
    """Micro-batches a (partial) structure's rows finish by a time: its fixed classes and
    candidates (`lines`, at t_fixed) and its open levels (`opened`, at t_open)."""

    lines: FixedLines
    opened: OpenValue | None
    m: float  # the global batch's micro-batches

    def by(self, t_fixed: np.ndarray, t_open: np.ndarray, whole: bool) -> np.ndarray:
        ones, value = self.lines.done(t_fixed, whole)
        return value if self.opened is None else self.opened.add(ones[-1], value, t_open,
                                                                 whole)

    def shortfall(self, t: np.ndarray) -> np.ndarray:
        """Micro-batches still to do at t, run fluidly."""
        return self.m - self.by(t, t, False)

    def counted_at(self, t_fixed: np.ndarray) -> OpenAfter:
        """`by(t_fixed, t, True)` as a function of t, the fixed classes counted once."""
        ones, value = self.lines.done(t_fixed, True)
        return OpenAfter(self.opened, ones[-1], value)


@dataclass(frozen=True)
class OpenAfter:
    """Whole micro-batches done by t, the fixed classes' counted at an earlier time."""

    opened: OpenValue
    dropped: np.ndarray
    value: np.ndarray

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return self.opened.add(self.dropped, self.value, t, True)


def walk_whole(finished: Finished, times: np.ndarray) -> np.ndarray:
    """From `times` (where the micro-batches, run fluidly, are done) on to the next time a
    fixed pipeline completes one while the whole micro-batches those finish, plus what
    the open levels can add before that time, still fall short; then, if levels are
    open, on within that last interval to where they make up the rest (`catch_up`)."""
    goal = finished.m * (1 - 1e-9)  # (per-slot values are fractions: sums round)
    for _ in range(int(finished.m) + 1):
        after = finished.lines.next_completion(times)
        ahead = np.isfinite(times) & np.isfinite(after)
        reached = finished.by(times, np.where(ahead, after, times), True)
        behind = ahead & (reached < goal)
        if not behind.any():
            break
        times = np.where(behind, after, times)
    if finished.opened is None:
        return times
    return catch_up(times, np.where(ahead, after, times), goal - reached,
                    finished.counted_at(times), goal)


def catch_up(times: np.ndarray, after: np.ndarray, short_after: np.ndarray,
             done: Callable[[np.ndarray], np.ndarray], goal: float) -> np.ndarray:
    """Between `times` and the next fixed completion `after`, where `goal` - done is
    `short_after` (at most 0), the fixed classes finish nothing more, so the step ends
    no sooner than the open levels make up the rest: `times` moves up to a t they still
    fall short at, within 0.1% of where they no longer do. done(t): micro-batches
    done by t, the fixed ones' counted at `times` (it rises in t, in steps: secant
    steps, and a halving after each that does not halve the bracket)."""
    low, high = times, after
    room = high - low > 2e-3 * high  # (per row: no room for more than the search's gap)
    if not room.any():
        return times
    short_low = goal - done(low)
    short_high = np.minimum(short_after, 0.0)
    active = room & (high > low) & (short_low > 0)
    halve = np.zeros(len(low), dtype=bool)
    while (active := active & (high - low > 1e-3 * high)).any():
        width = high - low
        secant = high - short_high * width / (short_high - short_low)
        t = np.where(halve, low + width / 2, np.clip(
            np.where(np.isfinite(secant), secant, low), low + 0.01 * width,
            high - 0.01 * width))
        value = goal - done(np.where(active, t, low))
        up, down = active & (value > 0), active & (value <= 0)
        low, short_low = np.where(up, t, low), np.where(up, value, short_low)
        high, short_high = np.where(down, t, high), np.where(down, value, short_high)
        halve = high - low > width / 2
    return np.where(short_low > 0, low, times)


def first_enough(short: Callable[[np.ndarray], np.ndarray], start: np.ndarray,
                 guess: np.ndarray) -> np.ndarray:
    """Per element, a t at which `short` (non-increasing in t) is still positive,
    within 0.1% of where it reaches 0, or the larger of start and guess if it is no
    longer positive there (the caller knows a bound of guess already): the bracket
    [that, beyond] shrinks by regula falsi (Illinois). Infinite where it never
    reaches 0 or start is infinite. (Called with numpy's divide and invalid
    warnings off, as in `Bound.many`.)"""
    low = np.where(np.isfinite(start), np.maximum(start, guess), start)
    short_low = short(np.where(np.isfinite(low), low, 0.0))
    answer = np.where(~np.isfinite(low) | (short_low <= 0), low, np.nan)
    high = np.maximum(low * 1.01, 1e-9)
    short_high = short(np.where(np.isfinite(high), high, 0.0))
    while True:  # widen until the bracket holds the answer
        grow = np.isnan(answer) & (short_high > 0)
        if not grow.any():
            break
        answer = np.where(grow & (high > 1e12), INF, answer)
        grow &= high <= 1e12
        low, short_low = np.where(grow, high, low), np.where(grow, short_high, short_low)
        high = np.where(grow, 2 * high, high)
        short_high = np.where(grow, short(high), short_high)
    side = np.zeros(len(low))
    while True:
        active = np.isnan(answer) & (high - low > 1e-3 * high)
        if not active.any():
            break
        t = high - short_high * (high - low) / (short_high - short_low)
        width = 0.01 * (high - low)  # (nan, where nothing is active: low)
        t = np.minimum(np.maximum(np.where(np.isnan(t), low, t), low + width), high - width)
        value = short(np.where(active, t, low))
        up = active & (value > 0)
        down = active & (value <= 0)
        short_high = np.where(up & (side == 1), short_high / 2, short_high)
        short_low = np.where(down & (side == -1), short_low / 2, short_low)
        low, short_low = np.where(up, t, low), np.where(up, value, short_low)
        high, short_high = np.where(down, t, high), np.where(down, value, short_high)
        side = np.where(up, 1, np.where(down, -1, side))
    return np.where(np.isnan(answer), low, answer)

"""Floors of runs of consecutive layers on one device type, for the families' first
bounds (`families.FamilyFloors`): the least largest part of any cut of a prefix (or
suffix, or any range) of the layers into c stages, the least busy times of a pipeline's last c
stages within memory, and the fewest seconds of recompute that free a number of
activation bytes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.solver.evaluate import Config, Space
from planner.solver.keys import (
    LeastLargestPartsKey,
    LeastLargestRangesKey,
    RecomputeCurveKey,
    TailsInMemoryKey,
)
from planner.solver.partition import INF
from planner.solver.table import CostTable
from planner.types.training import Recompute


def least_largest_parts(table: CostTable, kind: str, tp: int, mb: int, most: int,
                         from_end: bool = False) -> np.ndarray:
    """Per c = 1..most (a row each, c - 1) and layer boundary j (a column): the least
    largest busy time of a part over the cuts of layers [0, j) into c parts (of layers
    [j, L) `from_end`; infinite where there are fewer layers than parts): no stage of
    a block of c stages holding those layers is busy for less (a min-max program over
    the layers' forward and backward times, without sends, recompute and memory);
    slightly lowered against rounding (cached)."""
    key = LeastLargestPartsKey(kind, tp, mb, most, from_end)
    if key not in table.cache:
        costs = table.costs(kind, tp, mb)
        cum = np.concatenate([[0.0], np.cumsum(costs.fwd + costs.bwd)])
        size = len(cum)
        ranges = np.where(np.triu(np.ones((size, size), dtype=bool), 1),
                          cum[None, :] - cum[:, None], INF)
        rows = [ranges[:, -1] if from_end else ranges[0]]
        for _ in range(most - 1):
            rows.append(np.maximum(ranges, rows[-1][None, :]).min(axis=1) if from_end else
                        np.maximum(rows[-1][:, None], ranges).min(axis=0))
        table.cache[key] = np.array(rows) * (1 - 1e-9)
    return table.cache[key]


RANGE_CELLS = 1 << 21  # the most (layer boundaries)^3 `least_largest_ranges` is asked for


def least_largest_ranges(table: CostTable, kind: str, tp: int, mb: int, count: int
                         ) -> np.ndarray:
    """[i, j]: the least largest busy time of a part over the cuts of layers [i, j) into
    `count` parts (infinite where there are fewer layers than parts): no stage of a block
    of `count` stages holding those layers is busy for less (`least_largest_parts` for
    every range at once: a min-max program over the layers' forward and backward times,
    (L + 1)^3 cells a part, so asked for only up to `RANGE_CELLS`; cached, not lowered
    against rounding)."""
    key = LeastLargestRangesKey(kind, tp, mb, count)
    if key not in table.cache:
        if count == 1:
            costs = table.costs(kind, tp, mb)
            cum = np.concatenate([[0.0], np.cumsum(costs.fwd + costs.bwd)])
            size = len(cum)
            table.cache[key] = np.where(np.triu(np.ones((size, size), dtype=bool), 1),
                                        cum[None, :] - cum[:, None], INF)
        else:  # [i, k, j]: the first count - 1 parts hold [i, k), the last [k, j)
            fewer = least_largest_ranges(table, kind, tp, mb, count - 1)
            ranges = least_largest_ranges(table, kind, tp, mb, 1)
            table.cache[key] = np.maximum(fewer[:, :, None], ranges[None, :, :]).min(axis=1)
    return table.cache[key]


def tails_in_memory(table: CostTable, kind: str, tp: int, config: Config, space: Space,
                     most_stages: int, per_param: float) -> tuple[np.ndarray, np.ndarray]:
    """Per c = 1..most_stages (a row each, c - 1) and layer boundary j (a column): the
    least largest busy time of a stage, and the least sum of their busy times, over the
    cuts of layers [j, L) into c stages that are a pipeline's last, each stage's busy
    time that of the cheapest recompute policy its memory allows (`per_param` bytes of
    states per parameter, no ZeRO-3 gathers, no sends): the stage q from the end holds
    at least q + 1 micro-batches (1F1B's S - s; interleaved, more), and more in flight
    only needs more freed, so no block of a pipeline's last c stages does better.
    Infinite where nothing fits; slightly lowered against rounding (cached). Not for
    GPipe, whose stages hold their pipeline's share. Two programs over (layer, width),
    a range [a, a + d + 1) being row a, column d, as wide as any range's states allow."""
    key = TailsInMemoryKey(kind, tp, config.mb, config.interleave, most_stages,
                           tuple(space.policies), per_param)
    if key in table.cache:
        return table.cache[key]
    layers = table.num_layers
    held = np.concatenate([[0.0], np.cumsum(table.rank_params(tp))])
    room_all = table.type(kind).memory - table.type(kind).reserve
    starts = np.arange(layers + 1)
    width = int(max(0, (np.searchsorted(held, held + room_all / per_param, side="right")
                        - 1 - starts).max()))
    ends = starts[:, None] + np.arange(1, width + 1)[None, :]
    inside = ends <= layers
    after = np.minimum(ends, layers)  # the next stage's first layer

    def band(values: np.ndarray) -> np.ndarray:
        cum = np.concatenate([[0.0], np.cumsum(values)])
        return cum[after] - cum[starts][:, None]

    costs = table.costs(kind, tp, config.mb)
    room = np.where(inside, room_all - band(table.rank_params(tp)) * per_param, -INF)
    busy = band(costs.fwd + costs.bwd)
    mosts, times = [], []  # per policy: most micro-batches in flight that fit, busy time
    for policy in space.policies:
        acts = band(table.activations(policy, tp)) * config.mb
        with np.errstate(divide="ignore", invalid="ignore"):
            mosts.append(np.where(acts > 0, room / acts, np.where(room >= 0, INF, -INF)))
        times.append(busy + band(costs.recompute[policy]))

    def cost(q: int) -> np.ndarray:
        """The cheapest policy's time that fits q + 1 micro-batches, stage q from the end."""
        return np.minimum.reduce([np.where(m >= q + 1, t, INF) for m, t in zip(
            mosts, times, strict=True)])

    def next_stage(values: np.ndarray) -> np.ndarray:
        """values[a + d + 1] at [a, d] (the stage after range [a, a + d + 1)), infinite
        past the layers: a view, not a copy."""
        padded = np.concatenate([values[1:], np.full(width, INF)])
        return np.lib.stride_tricks.sliding_window_view(padded, width)[:len(starts)]

    last = layers - starts - 1  # the column of [a, L), where the band holds it
    whole = (last >= 0) & (last < width)
    alone = np.full(len(starts), INF)
    alone[whole] = cost(0)[whole, last[whole]]
    largest, sums = [alone], [alone]
    for q in range(1, most_stages):
        here = cost(q)
        largest.append(np.maximum(here, next_stage(largest[-1])).min(axis=1, initial=INF))
        sums.append((here + next_stage(sums[-1])).min(axis=1, initial=INF))
    table.cache[key] = (np.array(largest) * (1 - 1e-9), np.array(sums) * (1 - 1e-9))
    return table.cache[key]


def recompute_curve(table: CostTable, kind: str, tp: int, mb: int,
                    policies: Sequence[Recompute]) -> RecomputeCurve:
    """`RecomputeCurve` (cached)."""
    key = RecomputeCurveKey(kind, tp, mb, tuple(policies))
    if key not in table.cache:
        table.cache[key] = RecomputeCurve(table, kind, tp, mb, policies)
    return table.cache[key]


class RecomputeCurve:
    """The fewest seconds of recompute that free y bytes of activations (per
    micro-batch in flight) from any layers of a type: each layer's allowed policies
    as steps along its lower convex hull (freed bytes, seconds), all layers' steps in
    order of seconds per byte (a fractional choice, so no block of layers does
    better); infinite past what all of them free. Free where keeping all activations
    is not allowed (then the policies' times are not extra)."""

    def __init__(self, table: CostTable, kind: str, tp: int, mb: int,
                 policies: Sequence[Recompute]) -> None:
        costs = table.costs(kind, tp, mb)
        kept = table.activations(Recompute.NONE, tp) * mb
        freed = np.array([kept - table.activations(p, tp) * mb for p in policies]).T
        seconds = np.array([costs.recompute[p] if Recompute.NONE in policies
                            else np.zeros_like(kept) for p in policies]).T
        at = np.zeros((2, len(kept)))  # per layer, where its hull is: (bytes, seconds)
        rates, sizes = [], []
        for _ in policies:  # a hull step per round, each layer's cheapest rate onwards
            ahead = freed > at[0][:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                slope = np.where(ahead, (seconds - at[1][:, None]) / (freed - at[0][:, None]),
                                 INF)
            rate = slope.min(axis=1)
            rows = np.flatnonzero(rate < INF)
            if not len(rows):
                break
            far = np.where(ahead & (slope <= rate[:, None]), freed, -INF).argmax(axis=1)[rows]
            rates.append(rate[rows])
            sizes.append(freed[rows, far] - at[0][rows])
            at[:, rows] = freed[rows, far], seconds[rows, far]
        rate, size = (np.concatenate(x) if x else np.zeros(0) for x in (rates, sizes))
        order = np.argsort(rate, kind="stable")
        self.rates = rate[order]
        self.bytes = np.concatenate([[0.0], np.cumsum(size[order])])
        self.seconds = np.concatenate([[0.0], np.cumsum((rate * size)[order])])

    def __call__(self, freed: np.ndarray) -> np.ndarray:
        return np.where(freed > self.bytes[-1] + 1.0, INF,  # (a byte against rounding)
                        np.interp(freed, self.bytes, self.seconds))

    def worth(self, rate: np.ndarray) -> np.ndarray:
        """The bytes worth freeing where another way costs `rate` seconds per byte."""
        return self.bytes[np.searchsorted(self.rates, rate)]

"""Exact layer split of one pipeline class: contiguous, uneven ranges per stage, with
each stage's recompute policy and ZeRO stage chosen as the fastest that fits.

For a pipeline of S stages of given device types (and links between them), a
split b_0 = 0 < b_1 < ... < b_S = L gives each stage s the layers [b_s, b_s+1)
and per micro-batch a busy time t_s (forward + backward + recompute + ZeRO-3
gathers) and a send time c_s. Its time for m micro-batches is

    T(m) = (m - 1) * P + sum_s w_s,   h_s = max(t_s, c_s),  w_s = t_s + 2 c_s,
    P = max(max_s h_s, the round trips of 1F1B's in-flight limits (timing.py))

For a bottleneck bound M, G(M) = min sum_s w_s over splits with every h_s <= M
is a dynamic program over (stage, boundary) [Alpa, Metis]; G is a
non-increasing step function of M, and every split's T(m) is at least
(m - 1) * max(M, G(M) / S) + G(M) at the step it falls on (the whole pipeline's
round trip is one of the round trips). `optimize` finds the first step (the
smallest feasible bottleneck M0), G's floor G(inf) and, from the round trips of
the whole pipeline and of the stage pairs around its slow sends (`_least_period`)
and of every two neighbouring stages (`_neighbours_period`), a floor on the
period, which bound T(m) from below; `Staircase` lists the
steps, each priced with its exact period.

The search space uses these splits for a class: the steps of G, the splits with
no other split both faster in largest stage and in total, and, as gradient sync
and the optimizer step grow with a stage's parameters, where the pipelines run no
more micro-batches than they have stages (the fill, not the period, decides) the
steps of G over the splits under each cap on the parameters a stage holds
(`evaluate._useful_steps`): every split that no other beats in largest stage,
total and largest parameter count at once (GPipe: its front below, without the
caps). (Sync groups span
classes, so two classes' splits that cut at the same layers may sync faster
together; such pairs off these fronts are not searched.)

With v chunks per device (interleaved 1F1B, on a folded table: `interleave.py`),
h_s = max(t_s, b_s + v c_s) (b_s: the backward part of t_s) and
w_s = t_s / v + 2 v c_s, the last stage's t_s / v + 2 (v - 1) c_s (its send is the
wrap-around back to the first stage; `ClassCosts.h_w`):
the period is exactly max_s h_s, with no round trips, and T(m) = (m - 1) P + sum_s w_s
+ (1 - 1/v) P, so the staircase holds every split that can be best.

GPipe runs all forwards, then all backwards: T(m) = (m - 1) P + sum_s w_s with
P = max(F, C) + max(B, C) (the largest forward, backward and send; timing.py), at
least max_s h_s with h_s = max(t_s, 2 c_s), and no round trips. Its staircase
(`gpipe_front`) holds every split that no other beats in both P and the fill.

Memory of stage s (position s holds in-flight micro-batches of the schedule, all
of a pipeline's with GPipe) must fit: states sharded by ZeRO over the class's n
pipelines, activations by recompute policy, plus the framework reserve.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cost_models.comm import Collective, CommGroup
from cost_models.memory import kept_activations
from planner.solver.keys import (
    ActivationRangesKey,
    GathersKey,
    HwMemoKey,
    LeadBroadcastsKey,
    LedStageKey,
    PrefixesKey,
    RangeCapacityKey,
    ShardedParamsKey,
    StageKey,
    StageTimesKey,
    Zero3FirstKey,
)
from planner.solver.structure import wider_than_neighbours
from planner.solver.table import POLICIES, CostTable
from planner.solver.timing import (
    StageTiming,
    in_flight,
    pipeline_time,
    round_trip,
    stage_period,
)
from planner.types import LinkSpec, Schedule
from planner.types.training import Recompute

INF = float("inf")
ZERO_GATHER_REF = 2.0**30  # bytes; ZeRO-3 gathers are priced affinely from two points


@dataclass(frozen=True)
class Option:
    recompute: Recompute
    zero: int


@dataclass(frozen=True)
class Split:
    """A layer split and what it costs."""

    bounds: tuple[int, ...]  # b_0 = 0 < ... < b_S = L
    options: tuple[Option, ...]
    stages: tuple[StageTiming, ...]
    bottleneck: float  # the period: max(max_s h_s, 1F1B's round trips; see timing.py)
    total: float  # the fill: T(m) = (m - 1) * bottleneck + total
    largest_h: float  # max_s h_s
    weights: float  # sum_s w_s (the fill, less interleaving's (1 - 1/v) * bottleneck)

    def time(self, m: int) -> float:
        return (m - 1) * self.bottleneck + self.total


@dataclass
class ClassCosts:
    """The per-stage matrices of one class, and the dynamic program over them."""

    busy: list[np.ndarray]  # [s][b', b]: busy seconds (inf: infeasible)
    option: list[np.ndarray]  # [s][b', b]: index into `options`
    send: list[np.ndarray]  # [s][b]: one-way send seconds after layer b - 1
    options: tuple[Option, ...]
    parts: dict  # per-stage sums for rebuilding StageTiming
    links: tuple  # what each stage's send depends on (the last's: None, or the wrap-around)
    interleave: int = 1  # model chunks per device (interleaved 1F1B; see `h_w`)
    gpipe: bool = False  # GPipe's schedule (see `h_w` and `gpipe_front`)
    _hw: dict = field(default_factory=dict, repr=False)  # shared between classes
    _stage_hw: list = field(default_factory=list, repr=False, init=False)  # `h_w`, per stage

    @property
    def stages(self) -> int:
        return len(self.busy)

    def ways(self, s: int) -> float:
        """How many times the fill pays stage s's send: both ways once (1F1B), or
        interleaved both ways v times, the last stage's wrap-around v - 1 times."""
        v = self.interleave
        return 2.0 if v == 1 else 2.0 * (v if s < self.stages - 1 else v - 1)

    def h_w(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """h = max(busy, send) and w = busy + 2 send, per layer range [a, b); with v
        chunks per device (v > 1), h = max(busy, bwd + v send) and w = busy / v
        + 2 v send (the last stage's wrap-around: 2 (v - 1) send), interleaved 1F1B's
        period and fill (`timing.py`) being (m - 1) max_s h_s + sum_s w_s + (1 - 1/v)
        max_s h_s; GPipe, h = max(busy, 2 send), which no split's period max(F, C) +
        max(B, C) is below."""
        if not self._stage_hw:
            v = self.interleave
            for t in range(self.stages):
                ways = self.ways(t)
                key = (id(self.busy[t]), self.links[t], v, ways, self.gpipe)
                if key not in self._hw:
                    send = self.send[t][None, :]
                    hop = 2 * send if self.gpipe else send
                    if v > 1:  # the backward: busy less the forward (and its gather)
                        hop = self.busy[t] - self.forward(t) + v * send
                    self._hw[key] = (np.maximum(self.busy[t], hop),
                                     self.busy[t] / v + ways * send)
                self._stage_hw.append(self._hw[key])
        return self._stage_hw[s]

    @property
    def zero3_options(self) -> list[int]:
        """The indices of `options` on ZeRO-3."""
        return [i for i, o in enumerate(self.options) if o.zero == 3]

    def forward(self, s: int) -> np.ndarray:
        """Per layer range [a, b) of stage s, the forward seconds of its option: on
        ZeRO-3, with the gather before it, and where the stage is wider than the one
        before, the broadcast of its input (`split_at`)."""
        fwd, lead = self.parts[s]["fwd"], self.parts[s]["lead_in"]
        out = fwd[None, :] - fwd[:, None] + np.where(
            np.isin(self.option[s], self.zero3_options), self.parts[s]["gather"], 0.0)
        return out + lead[:, None] if lead.any() else out

    def solve(self, bound: float) -> tuple[float, list[np.ndarray]]:
        """G(bound) and the argmin tables to rebuild the split."""
        return _least_sum([self.h_w(s)[0] for s in range(self.stages)],
                          [self.h_w(s)[1] for s in range(self.stages)], bound)

    def cost(self, bound: float, pairs: Sequence[int] = ()) -> float:
        """G(bound) alone (`solve` without the argmin tables); with `pairs` (stages s
        that open a window with s + 1, disjoint), the least sum over those windows of
        their busy times and the sends inside them instead."""
        g = _start(self.busy[0].shape[0])
        rows = slice(0, 1)
        firsts = set(pairs) if pairs else None
        for s in range(self.stages):
            h, w = self.h_w(s)
            if firsts is not None:
                w = w if s in firsts else self.busy[s] if s - 1 in firsts else None
            total = g[rows, None] + (0.0 if w is None else w[rows])
            if bound < INF or w is None:  # (w is infinite wherever h is)
                total = np.where(h[rows] <= bound, total, INF)
            g = total.min(axis=0)
            rows = _reached(g)
            if rows is None:
                return INF
        return float(g[-1])

    def slow_pairs(self) -> tuple[int, ...]:
        """Stages s whose send to s + 1 takes a link slower than the class's fastest
        (e.g. across nodes), as windows of two stages, disjoint, slowest first."""
        links = self.links[:-1]  # (the last stage sends nothing)
        if not links:
            return ()
        fastest = max(link.bandwidth for link in links)
        chosen: set[int] = set()
        for s in sorted(range(len(links)), key=lambda s: (links[s].bandwidth, s)):
            if links[s].bandwidth < fastest and not {s - 1, s, s + 1} & chosen:
                chosen.add(s)
        return tuple(sorted(chosen))

    def windows_fit(self, period: float) -> bool:
        """Whether some split keeps every stage's h_s and every two neighbours' round
        trip ((busy_s + busy_s+1 + 2 c_s) / 2) within `period`: a dynamic program over
        the least busy time of stage s ending at each layer boundary (the only thing of
        a feasible prefix the next window depends on). Stage s may start at boundary a
        with at most min(P, 2P - least busy of stage s-1 ending at a - 2 c_s-1(a))."""
        g = _start(self.busy[0].shape[0])
        rows, into = slice(0, 1), np.zeros_like(g)  # (no send into the first stage)
        for s in range(self.stages):
            room = np.minimum(period, 2 * (period - into[rows]) - g[rows])
            busy = self.busy[s][rows]
            g = np.where(busy <= room[:, None], busy, INF).min(axis=0)
            g[self.send[s] > period] = INF
            rows, into = _reached(g), self.send[s]
            if rows is None:
                return False
        return bool(g[-1] < INF)

    def min_bottleneck(self) -> float:
        """The smallest achievable max_s h_s."""
        return _least_max([self.h_w(s)[0] for s in range(self.stages)])

    def phi_beta(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per stage and layer range [a, b), GPipe's phi (the forward or the send,
        whichever is longer) and beta (the backward or the send); infinite where
        nothing fits. ZeRO-3 gathers once for the forward and twice more for the
        backward, which also holds recompute."""
        phi, beta = [], []
        for s in range(self.stages):
            busy, send, fwd = self.busy[s], self.send[s][None, :], self.forward(s)
            phi.append(np.where(np.isfinite(busy), np.maximum(fwd, send), INF))
            beta.append(np.maximum(busy - fwd, send))
        return phi, beta

    def split(self, choices: list[np.ndarray]) -> Split:
        """The split the dynamic program's argmin tables describe."""
        return self.split_at(self.bounds(choices))

    def bounds(self, choices: list[np.ndarray]) -> tuple[int, ...]:
        """The bounds of the split the dynamic program's argmin tables describe."""
        bounds = [self.busy[0].shape[0] - 1]
        for s in range(self.stages - 1, -1, -1):
            bounds.append(int(choices[s][bounds[-1]]))
        return tuple(reversed(bounds))

    def split_at(self, bounds: Sequence[int]) -> Split | None:
        """Any split given by its bounds (None if a stage does not fit in memory)."""
        if any(not np.isfinite(self.busy[s][bounds[s], bounds[s + 1]])
               for s in range(self.stages)):
            return None
        options, stages = [], []
        for s in range(self.stages):
            a, b = bounds[s], bounds[s + 1]
            option = self.options[int(self.option[s][a, b])]
            p = self.parts[s]
            send = float(self.send[s][b])
            gather = float(p["gather"][a, b]) if option.zero == 3 else 0.0
            lead_in, lead_out = float(p["lead_in"][a]), float(p["lead_out"][b])
            fwd = p["fwd"][b] - p["fwd"][a] + gather + lead_in  # ZeRO-3: gather weights for
            bwd = (p["bwd"][b] - p["bwd"][a] + p["rec"][option.recompute][b]  # forward, and
                   - p["rec"][option.recompute][a] + 2 * gather  # again and reduce-scatter
                   + lead_out)  # grads; the broadcasts of a stage wider than its neighbours
            stages.append(StageTiming(
                fwd=float(fwd), bwd=float(bwd),
                tp_fwd=float(p["tp_fwd"][b] - p["tp_fwd"][a]) + lead_in,
                tp_bwd=float(p["tp_bwd"][b] - p["tp_bwd"][a]) + lead_out,
                recompute=float(p["rec"][option.recompute][b] - p["rec"][option.recompute][a]),
                send=send))
            options.append(option)
        v = self.interleave  # h and w as `h_w`
        weights = sum(st.busy / v + self.ways(s) * st.send for s, st in enumerate(stages))
        if self.gpipe:  # a forward pipeline, then a backward one (timing.py)
            period = pipeline_time(stages, 1, schedule=Schedule.GPIPE).period
            return Split(bounds=tuple(bounds), options=tuple(options), stages=tuple(stages),
                         bottleneck=period, total=weights, largest_h=period, weights=weights)
        largest = max(stage_period(st, v) for st in stages)
        # the round trips of 1F1B's in-flight limits bound the period too (timing.py);
        # interleaved, the period is max_s h_s and the fill adds (1 - 1/v) of it
        trips = round_trip([s.busy for s in stages], [s.send for s in stages[:-1]]) \
            if v == 1 else 0.0
        return Split(bounds=tuple(bounds), options=tuple(options), stages=tuple(stages),
                     bottleneck=max(largest, trips), total=weights + (1 - 1 / v) * largest,
                     largest_h=largest, weights=weights)


def _reached(g: np.ndarray) -> slice | None:
    """The layer boundaries from the first to the last a prefix reaches (None: none)."""
    reached = g < INF
    first = int(reached.argmax())
    return slice(first, len(g) - int(reached[::-1].argmax())) if reached[first] else None


def _start(size: int) -> np.ndarray:
    """Per layer boundary, 0 at the first and infinite elsewhere."""
    g = np.full(size, INF)
    g[0] = 0.0
    return g


def _least_sum(h: Sequence[np.ndarray], w: Sequence[np.ndarray], bound: float
               ) -> tuple[float, list[np.ndarray]]:
    """The least sum over stages of w_s(range) over splits with every h_s(range) <= bound
    (a dynamic program over (stage, boundary)), and its argmin tables."""
    g = _start(h[0].shape[0])
    rows, choices = slice(0, 1), []
    for hs, ws in zip(h, w, strict=True):
        total = g[rows, None] + np.where(hs[rows] <= bound, ws[rows], INF)
        arg = total.argmin(axis=0)
        g = total[arg, np.arange(len(g))]
        choices.append(arg + rows.start)
        rows = _reached(g)
        if rows is None:
            return INF, choices
    return float(g[-1]), choices


def _least_sum_value(h: Sequence[np.ndarray], w: Sequence[np.ndarray], bound: float
                     ) -> float:
    """`_least_sum`'s value alone (no argmin tables: cheaper)."""
    g = _start(h[0].shape[0])
    rows = slice(0, 1)
    for hs, ws in zip(h, w, strict=True):
        g = (g[rows, None] + np.where(hs[rows] <= bound, ws[rows], INF)).min(axis=0)
        rows = _reached(g)
        if rows is None:
            return INF
    return float(g[-1])


def _least_max(h: Sequence[np.ndarray]) -> float:
    """The least max over stages of h_s(range) over splits (a min-max program)."""
    g = _start(h[0].shape[0])
    rows = slice(0, 1)
    for hs in h:
        g = np.maximum(g[rows, None], hs[rows]).min(axis=0)
        rows = _reached(g)
        if rows is None:
            return INF
    return float(g[-1])


def _next_bound(least: Callable[[float], float], steps: np.ndarray, bound: float,
                total: float) -> float | None:
    """The next step of a staircase: the smallest of `steps` above `bound` at which the
    least fill (`least`, non-increasing) falls below `total` (None if none does; the
    largest is tried first, as the walks of `_walked_front` often have no next step,
    where `Staircase.extend`'s usually has one)."""
    lo, hi = bisect.bisect_right(steps, bound), len(steps) - 1
    if lo > hi or not least(float(steps[hi])) < total - 1e-12:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if least(float(steps[mid])) < total - 1e-12:
            hi = mid
        else:
            lo = mid + 1
    return float(steps[lo])


_ENUMERATED = 4_000_000  # GPipe fronts of at most this many splits are found by enumeration,
_SPLITS_PER_CAP = 2000  # where fewer than this per stage for each cap a walk would take


def _enumerated_front(costs: ClassCosts, phi: list[np.ndarray], beta: list[np.ndarray],
                      fill: list[np.ndarray], limit: float, deadline: float | None = None
                      ) -> list[Split]:
    """`gpipe_front` by pricing every split (few stages: few splits), a first cut at a
    time, stage by stage, dropping those whose stages so far already reach the limit
    in period; each batch keeps only its own front (the whole front's splits are on
    their batch's)."""
    layers, stages = phi[0].shape[0] - 1, costs.stages
    kept = [np.zeros((0, stages + 3))]
    for first in range(1, layers - stages + 2) if stages > 1 else [layers]:
        check_time(deadline)
        cuts = np.array([[0, first]])
        top_phi, top_beta, weight = (x[0][0, [first]] for x in (phi, beta, fill))
        for s in range(1, stages):  # stage s takes [last, new); the last ends the model
            last = cuts[:, -1]
            low = last + 1 if s < stages - 1 else np.full_like(last, layers)
            counts = layers - (stages - 1 - s) - low + 1
            row = np.repeat(np.arange(len(last)), counts)
            new = np.repeat(low - (np.cumsum(counts) - counts), counts) + np.arange(
                int(counts.sum()))
            start = last[row]
            most_phi = np.maximum(top_phi[row], phi[s][start, new])
            most_beta = np.maximum(top_beta[row], beta[s][start, new])
            ok = most_phi + most_beta < limit
            cuts = np.column_stack([cuts[row[ok]], new[ok]])
            top_phi, top_beta = most_phi[ok], most_beta[ok]
            weight = weight[row[ok]] + fill[s][start[ok], new[ok]]
        period = top_phi + top_beta
        front = _unbeaten(period, weight, limit)
        kept.append(np.column_stack([period[front], weight[front], cuts[front]]))
    found = np.concatenate(kept)
    return [costs.split_at(tuple(int(x) for x in found[i, 2:]))
            for i in _unbeaten(found[:, 0], found[:, 1], limit)]


def _unbeaten(periods: np.ndarray, weights: np.ndarray, limit: float) -> list[int]:
    """The indices, by period, of the points below `limit` in period that no other
    beats in both period and weight (one of each tie)."""
    order = np.lexsort((weights, periods))
    order = order[periods[order] < limit]
    # (only a point lighter than every one before it can be kept: few are)
    lighter = weights[order] < np.minimum.accumulate(
        np.concatenate([[INF], weights[order][:-1]]))
    kept: list[int] = []
    best = INF
    for i in order[lighter].tolist():
        if weights[i] < best - 1e-12:
            best = weights[i]
            kept.append(i)
    return kept


class OutOfTime(Exception):
    """A search's deadline passed inside the pricing of one structure."""


def check_time(deadline: float | None) -> None:
    """Raise `OutOfTime` once past `deadline` (a `time.perf_counter` value; None: never)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


def gpipe_front(costs: ClassCosts, limit: float = INF, deadline: float | None = None
                ) -> list[Split]:
    """GPipe's staircase: every split with a period below `limit` that no other beats
    in both period and fill, by period. A split's period is max_s phi_s + max_s beta_s
    (phi_s: stage s's forward or its send, whichever is longer; beta_s: its backward
    or send; timing.py), which is not one term per stage: where the splits are few
    against the caps a walk would take (measured: pricing 2,000 splits takes about
    as long as one stage of one cap's walk), every one is priced (`_enumerated_front`),
    else `_walked_front` finds them (either raises `OutOfTime` past the deadline)."""
    phi, beta = costs.phi_beta()
    fill = [costs.h_w(s)[1] for s in range(costs.stages)]
    splits = math.comb(phi[0].shape[0] - 2, costs.stages - 1)
    walk = splits > _ENUMERATED or splits > _SPLITS_PER_CAP * costs.stages * _caps(
        phi, beta, limit)
    return (_walked_front if walk else _enumerated_front)(costs, phi, beta, fill, limit,
                                                          deadline)


def _caps(phi: list[np.ndarray], beta: list[np.ndarray], limit: float) -> int:
    """How many forward caps a walk of `_walked_front` may take below `limit` at most."""
    caps = np.unique(np.concatenate([p[np.isfinite(p)] for p in phi]))
    return int(np.searchsorted(caps, limit - _least_max(beta))) - int(
        np.searchsorted(caps, _least_max(phi)))


def _walked_front(costs: ClassCosts, phi: list[np.ndarray], beta: list[np.ndarray],
                  fill: list[np.ndarray], limit: float, deadline: float | None = None
                  ) -> list[Split]:
    """`gpipe_front` by dynamic programs: for each forward cap X (every value a phi
    takes, upward) the splits with all phi_s <= X are walked as 1F1B's staircase is,
    by their largest beta, each step the least fill below it; the caps stop once no
    split with a larger phi can come below the limit or the period of one at the least
    fill, and a cap is skipped where every range whose phi it is has a beta that keeps
    the splits holding it there too (those with a smaller phi were walked before). A
    walk steps only to splits lighter than every split found no slower than its step
    so far (a split it passes over is beaten by one of those, or, its largest phi below
    the cap, by one of an earlier cap's walk)."""
    floor = costs.cost(INF)
    least_beta, lowest = _least_max(beta), _least_max(phi)
    # per value a phi takes, the least beta of a range with that phi
    pairs = np.concatenate([np.stack([p[np.isfinite(p)], b[np.isfinite(p)]])
                            for p, b in zip(phi, beta, strict=True)], axis=1)
    pairs = pairs[:, np.argsort(pairs[0], kind="stable")]
    caps, starts = np.unique(pairs[0], return_index=True)
    least_at = np.minimum.reduceat(pairs[1], starts)
    points: list[tuple[float, float, tuple[int, ...]]] = []  # period, fill, bounds

    def found(choices: list[np.ndarray]) -> tuple[float, float]:
        """Record the split the argmin tables describe (priced as `_enumerated_front`)."""
        bounds = costs.bounds(choices)
        ranges = list(itertools.pairwise(bounds))
        period = (max(float(p[a, b]) for p, (a, b) in zip(phi, ranges, strict=True))
                  + max(float(x[a, b]) for x, (a, b) in zip(beta, ranges, strict=True)))
        weight = sum(float(w[a, b]) for w, (a, b) in zip(fill, ranges, strict=True))
        points.append((period, weight, bounds))
        return period, weight

    done = limit  # the least period of a split at the least fill (or the limit)
    for cap, least in zip(caps, least_at, strict=True):
        check_time(deadline)
        if cap + least_beta >= done:
            break
        if cap < lowest or cap + least >= done:
            continue
        capped = [np.where(p <= cap, b, INF) for p, b in zip(phi, beta, strict=True)]
        steps = np.unique(np.concatenate([c[np.isfinite(c)] for c in capped]))
        bound = _least_max(capped)
        while bound is not None and cap + bound < done:
            total, choices = _least_sum(capped, fill, bound)
            period, _ = found(choices)
            if total <= floor + 1e-12:
                done = min(done, period)
                break
            # a later step, slower, must be lighter than every split found up to here
            lightest = min((w for p, w, _ in points if p <= cap + bound), default=total)
            bound = _next_bound(lambda b, capped=capped: _least_sum_value(capped, fill, b),
                                steps[:bisect.bisect_left(steps, done - cap)], bound,
                                min(total, lightest))
    kept = _unbeaten(np.array([p for p, _, _ in points]), np.array([w for _, w, _ in points]),
                     limit)
    return [costs.split_at(points[i][2]) for i in kept]


def _prefixes(table: CostTable, kind: str, tp: int, mb: int) -> tuple:
    """Prefix sums of a type's per-layer times and their [a, b) range matrices (cached)."""
    key = PrefixesKey(kind, tp, mb)
    if key not in table.cache:
        costs = table.costs(kind, tp, mb)
        prefix = {name: np.concatenate([[0.0], np.cumsum(getattr(costs, name))])
                  for name in ("fwd", "bwd", "tp_fwd", "tp_bwd")}
        rec = {p: np.concatenate([[0.0], np.cumsum(costs.recompute[p])]) for p in POLICIES}
        rec_range = {p: rec[p][None, :] - rec[p][:, None] for p in POLICIES}
        busy = prefix["fwd"] + prefix["bwd"]
        table.cache[key] = (prefix, rec, rec_range, busy[None, :] - busy[:, None])
    return table.cache[key]


def _options(n: int, policies: Sequence[Recompute], zeros: Sequence[int]) -> tuple[Option, ...]:
    """ZeRO-1 and -2 cost no compute time and shrink memory and the optimizer step, so a
    stage uses the most sharded of {0, 1, 2} allowed, or ZeRO-3 if only that fits."""
    cheap = max((z for z in zeros if z <= 2 and (z == 0 or n > 1)), default=None)
    levels = [z for z in (cheap, 3 if 3 in zeros and n > 1 else None) if z is not None]
    return tuple(Option(p, z) for p in policies for z in levels)


def _capacity(table: CostTable, kind: str, tp: int, mb: int, n: int,
              options: Sequence[Option]) -> list[np.ndarray]:
    """Per option, the most micro-batches in flight that fit in memory on a device of
    type `kind` holding the layer range [a, b) (-inf: none, or not a range): states
    sharded by ZeRO over n pipelines, and the activations a stage keeps, linear in the
    micro-batches in flight (`cost_models.memory.kept_activations`, the rule reports use
    too: per policy, with full recompute the largest single layer's again; cached)."""
    key = RangeCapacityKey(kind, tp, mb, n, tuple(options))
    if key not in table.cache:
        range_params = table.range_params(tp)
        acts, range_max, valid = _activation_ranges(table, tp)
        info = table.type(kind)
        out = []
        for option in options:
            z = option.zero
            per_param, sharded = table.bytes_per_param(0, 1), table.bytes_per_param(z, n)
            # tied weights the runtime keeps out of ZeRO stay whole (`CostTable.zero_kept`)
            state = range_params * sharded + table.zero_kept(z) * (per_param - sharded)
            policy = option.recompute
            base = kept_activations(acts[policy], range_max, recompute=policy, micro_batch=mb,
                                    in_flight=0)
            act = kept_activations(acts[policy], range_max, recompute=policy, micro_batch=mb,
                                   in_flight=1) - base
            slack = info.memory - info.reserve - state - base
            with np.errstate(divide="ignore", invalid="ignore"):
                most = np.where(act > 0, slack / act, INF)
            most[~valid | (slack < 0)] = -INF
            out.append(most)
        table.cache[key] = out
    return table.cache[key]


def _activation_ranges(table: CostTable, tp: int) -> tuple:
    """[a, b) range matrices of activation bytes per sample per policy, of the largest
    single layer's activations, and of which (a, b) are ranges (cached)."""
    key = ActivationRangesKey(tp)
    if key not in table.cache:
        size = table.num_layers + 1
        acts = {}
        for p in POLICIES:
            prefix = np.concatenate([[0.0], np.cumsum(table.activations(p, tp))])
            acts[p] = prefix[None, :] - prefix[:, None]
        none_act = table.activations(Recompute.NONE, tp)
        range_max = np.zeros((size, size))
        for a in range(size - 1):
            range_max[a, a + 1:] = np.maximum.accumulate(none_act[a:])
        table.cache[key] = (acts, range_max, np.triu(np.ones((size, size), dtype=bool), 1))
    return table.cache[key]


def _gathers(table: CostTable, gather: tuple[float, float]) -> np.ndarray:
    """Seconds of one ZeRO-3 all-gather of the weights of every layer range [a, b)
    (cached): each of the tp ranks gathers its shard, together the whole stage, but
    for the tied weights it owns, which ZeRO-3 keeps whole (`CostTable.zero_kept`).
    With v chunks per device (a folded table) each chunk gathers its own: v latencies."""
    key = GathersKey(tuple(gather))
    if key not in table.cache:
        weight_bytes = sharded_params(table) * table.weight_bytes
        table.cache[key] = (table.interleave * gather[0] + (gather[1] - gather[0])
                            * weight_bytes / ZERO_GATHER_REF) * (weight_bytes > 0)
    return table.cache[key]


def sharded_params(table: CostTable) -> np.ndarray:
    """The parameters ZeRO-3 shards in every layer range [a, b): all but the tied
    weights it owns, which it keeps whole (cached)."""
    key = ShardedParamsKey()
    if key not in table.cache:
        params = np.concatenate([[0.0], np.cumsum(table.params)])
        sharded = params[None, :] - params[:, None]
        a, b = np.ogrid[:len(params), :len(params)]
        for owner, weights in table.tied_weights:
            sharded = sharded - weights * ((a <= owner) & (owner < b))
        table.cache[key] = np.maximum(sharded, 0.0)
    return table.cache[key]


def least_zero3_busy(table: CostTable, kind: str, *, tp: int, mb: int,
                     gather: tuple[float, float], held: float) -> float:
    """The least busy time per micro-batch of a stage of type `kind` on ZeRO-3 that
    shards at least `held` parameters: its layers plus three gathers (`_gathers`),
    over every layer range that holds that many (infinite where none does)."""
    busy = _prefixes(table, kind, tp, mb)[3] + 3 * _gathers(table, gather)
    a, b = np.ogrid[:table.num_layers + 1, :table.num_layers + 1]
    return float(np.min(busy, where=(a < b) & (sharded_params(table) >= held), initial=INF))


def zero3_first(table: CostTable, costs: ClassCosts, kind: str, *, tp: int, mb: int,
                gather: tuple[float, float]) -> ClassCosts:
    """The class's costs if its first stage (of type `kind`) must use ZeRO-3: no faster
    than before, nor than its layers plus three gathers per micro-batch. For bounds
    only: the first stage's option is a ZeRO-3 one everywhere (its recompute policy
    may not be the one the busy time holds), so that the backward an interleaved
    stage's period takes (`ClassCosts.h_w`) leaves out the forward's gather."""
    key = Zero3FirstKey(id(costs.busy[0]), kind, tp, mb, tuple(gather))
    if key not in table.cache:  # kept, as h_w caches by the array's id
        base = _prefixes(table, kind, tp, mb)[3]
        zero3 = costs.zero3_options
        table.cache[key] = (costs.busy[0], np.maximum(
            costs.busy[0], base + 3 * _gathers(table, gather)),
            np.full_like(costs.option[0], zero3[0]) if zero3 else costs.option[0])
    _, busy, option = table.cache[key]
    return dataclasses.replace(costs, busy=[busy, *costs.busy[1:]],
                               option=[option, *costs.option[1:]])


def _stage(table: CostTable, kind: str, *, tp: int, mb: int, n: int, flight: float,
           gather: tuple[float, float], policies: Sequence[Recompute], zeros: Sequence[int]
           ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Busy time and option of every layer range [a, b) as one stage (cached)."""
    key = StageKey(kind, tp, mb, n, flight, tuple(gather) if n > 1 else None, tuple(policies),
                   tuple(zeros))
    if key in table.cache:
        return table.cache[key]
    prefix, rec, rec_range, base = _prefixes(table, kind, tp, mb)
    options = _options(n, policies, zeros)
    gathers = _gathers(table, gather)
    times_key = StageTimesKey(kind, tp, mb, tuple(gather) if n > 1 else None, options)
    if times_key not in table.cache:  # per option, independent of memory
        table.cache[times_key] = [base + rec_range[o.recompute]
                                  + (3 * gathers if o.zero == 3 else 0.0) for o in options]
    busy = np.full(base.shape, INF)
    choice = np.zeros(base.shape, dtype=np.int16)
    capacity = _capacity(table, kind, tp, mb, n, options)
    for i, (most, t) in enumerate(zip(capacity, table.cache[times_key], strict=True)):
        better = (most >= flight) & (t < busy)
        busy = np.where(better, t, busy)
        choice[better] = i

    parts = {**prefix, "rec": rec, "gather": gathers}
    table.cache[key] = (busy, choice, parts)
    return table.cache[key]


def class_costs(table: CostTable, types: Sequence[str], *, tps: Sequence[int], mb: int,
                n: int, links: Sequence[LinkSpec], gathers: Sequence[tuple[float, float]],
                schedule: Schedule, policies: Sequence[Recompute], zeros: Sequence[int],
                interleave: int = 1, microbatches: int | None = None) -> ClassCosts:
    """Matrices of busy time, option choice and send time for every stage position
    (with `interleave` chunks per device, of a folded table: `interleave.py`); tps[s]:
    stage s's tensor-parallel degree.

    links[s]: the link of stage s's send to s + 1; interleaved (S > 1), one more,
    the last stage's wrap-around back to the first (the folded table's last boundary
    is then the largest output of a round's last layer but the final round's).

    gathers[s]: seconds of a ZeRO-3 all-gather among the class's pipelines at stage s
    of 1 byte and of ZERO_GATHER_REF bytes (gathers are priced affinely between).
    microbatches: the most a pipeline runs, which GPipe holds all at once (needed
    for it; else the schedule's in-flight limit).

    A stage wider than the one before it receives each forward's input on its first
    rank, which broadcasts it to the others (`runtime/follow.py`); one wider than the
    one after it, each backward's output gradient: `lead_in` and `lead_out`, per layer
    boundary, which its busy time holds."""
    if schedule is Schedule.GPIPE and microbatches is None:
        raise ValueError("GPipe's memory needs the pipelines' micro-batch count")
    if interleave > 1 and len(set(tps)) > 1:
        raise ValueError(f"interleaved stages share one tensor-parallel degree, got {tps}")
    boundary = np.concatenate([[0.0], table.boundary]) * mb
    busy_all, option_all, send_all, parts_all = [], [], [], []
    for s, (kind, leads) in enumerate(zip(types, wider_than_neighbours(tps), strict=True)):
        busy, choice, parts = _stage(
            table, kind, tp=tps[s], mb=mb, n=n,
            flight=in_flight(s, len(types), microbatches or 10**9, schedule, interleave),
            gather=tuple(gathers[s]), policies=policies, zeros=zeros)
        lead_in, lead_out = (_broadcasts(table, kind, tps[s], mb) if lead
                             else np.zeros_like(boundary) for lead in leads)
        if any(leads):  # (kept in the table: `ClassCosts.h_w` caches by the array's id)
            key = LedStageKey(id(busy), leads)
            if key not in table.cache:
                table.cache[key] = (busy, busy + lead_in[:, None] + lead_out[None, :])
            busy = table.cache[key][1]
        busy_all.append(busy)
        option_all.append(choice)
        send_all.append(np.zeros_like(boundary) if s >= len(links) else
                        links[s].latency + boundary / links[s].bandwidth)
        parts_all.append({**parts, "lead_in": lead_in, "lead_out": lead_out})
    if len(links) != len(types) - (1 if interleave == 1 or len(types) == 1 else 0):
        raise ValueError(f"{len(types)} stages of {interleave} chunks need a link per send, "
                         f"got {len(links)}")
    hw = table.cache.setdefault(HwMemoKey(mb), {})
    return ClassCosts(busy=busy_all, option=option_all, send=send_all,
                      options=_options(n, policies, zeros), parts=parts_all,
                      links=(*links, None)[:len(types)], interleave=interleave,
                      gpipe=schedule is Schedule.GPIPE, _hw=hw)


def _broadcasts(table: CostTable, kind: str, tp: int, mb: int) -> np.ndarray:
    """Per layer boundary, the broadcast of its activations (mb samples) among a
    stage's tp ranks on a node of type `kind` (its first node, as `CostTable.costs`
    prices the stage's all-reduces; cached)."""
    key = LeadBroadcastsKey(kind, tp, mb)
    if key not in table.cache:
        group = CommGroup(((table.type(kind).nodes[0], tp),))
        sizes = np.concatenate([[0.0], table.boundary]) * mb
        once = {x: table.collective(Collective.BROADCAST, x, group) for x in set(sizes.tolist())}
        table.cache[key] = np.array([once[x] if x > 0 else 0.0 for x in sizes.tolist()])
    return table.cache[key]


@dataclass(frozen=True)
class ClassResult:
    """The first step of G (smallest bottleneck), G's floor and floors on the period
    and the fill."""

    costs: ClassCosts
    least_weights: float  # G(inf): no split has a smaller sum_s w_s
    smallest_max: float  # M0: no split has a smaller max_s h_s
    first: Split  # the cheapest split with the smallest bottleneck
    min_period: float  # no split of this class has a shorter period (`_neighbours_period`)

    @property
    def floor(self) -> float:
        """No split of this class has a smaller fill (`Split.total`)."""
        return self.least_weights + (1 - 1 / self.costs.interleave) * self.min_period

    def lower(self, m: int) -> float:
        """No split of this class runs m micro-batches faster."""
        return (m - 1) * self.min_period + self.floor


_PERIOD_TRIES = 3  # bisections of `_least_period`


def optimize(costs: ClassCosts) -> ClassResult | None:
    """The smallest feasible bottleneck and its cheapest split, or None if nothing fits."""
    bottleneck = costs.min_bottleneck()
    if not np.isfinite(bottleneck):
        return None
    floor = costs.cost(INF)
    first = costs.split(costs.solve(bottleneck)[1])
    # interleaved, the period is max_s h_s: no round trips (`h_w`); GPipe's is at least
    # that, and the least largest phi plus the least largest beta (`gpipe_front`)
    if costs.gpipe:
        period = max(bottleneck, sum(map(_least_max, costs.phi_beta())))
    else:
        period = bottleneck if costs.interleave > 1 else _neighbours_period(
            costs, _least_period(costs, bottleneck, floor), first.bottleneck)
    return ClassResult(costs=costs, least_weights=floor, smallest_max=bottleneck, first=first,
                       min_period=period)


def _neighbours_period(costs: ClassCosts, low: float, high: float) -> float:
    """The larger of `low` (a floor on every split's period) and the least period
    that keeps every stage and every two neighbours' round trip within it (exact for
    two stages), found by bisection from `high` (a split's period) to within 0.1%:
    a split whose largest stage holds one layer more than the fluid share shows in
    its neighbours' windows, not in the means `_least_period` takes."""
    if high <= low or costs.windows_fit(low):
        return low
    while high > low * (1 + 1e-3):
        middle = (low + high) / 2
        low, high = (low, middle) if costs.windows_fit(middle) else (middle, high)
    return low


def _least_period(costs: ClassCosts, smallest_max: float, floor: float) -> float:
    """A floor on every split's period. A split whose largest h_s is M has a period of
    at least M and at least the mean of any window of its stages' round trips (the
    busy times and both ways of the sends inside a run of stages, over its stages):
    the whole pipeline (total / S, at least G(M) / S) and, where some sends are
    slower than others, the pairs of stages around them (their least sum over a
    split below M, over their stages). So for any x, every split's period is at
    least min(x, that least sum at x over the stages): those with M <= x sum at
    least that much, the others have a period above x. That is largest where the
    two meet, which a few bisections approach from max(M0, G(inf) / S)."""
    best = max(smallest_max, floor / costs.stages)
    pairs = costs.slow_pairs()
    for windows, stages in (((), costs.stages), (pairs, 2 * len(pairs))):
        if not stages:
            continue
        low, high = best, costs.cost(best, windows) / stages
        for _ in range(_PERIOD_TRIES if high > low * (1 + 1e-6) else 0):
            x = (low + high) / 2
            g = costs.cost(x, windows) / stages
            best = max(best, min(x, g))
            low, high = (x, high) if g >= x else (low, x)
    return best


class Staircase:
    """The steps of G in order of their largest stage time, found as they are asked
    for (`extend`): the splits whose (bottleneck, total) make T(m) exact for all m."""

    def __init__(self, result: ClassResult) -> None:
        self.result = result
        self.points = [result.first]
        self.complete = result.first.weights <= result.least_weights + 1e-12
        self._largest_h = result.smallest_max
        self._cands: np.ndarray | None = None

    def extend(self) -> bool:
        """Append the next step; False (and nothing appended) once there is none."""
        if self.complete:
            return False
        costs = self.result.costs
        if self._cands is None:
            hs = [costs.h_w(s)[0] for s in range(costs.stages)]
            self._cands = np.unique(np.concatenate([h[np.isfinite(h)] for h in hs]))
        cands, current = self._cands, self.points[-1]
        lo = bisect.bisect_right(cands, self._largest_h)
        hi = len(cands) - 1
        if lo > hi:
            self.complete = True
            return False
        while lo < hi:  # smallest bound whose G is below the current total
            mid = (lo + hi) // 2
            if costs.cost(float(cands[mid])) < current.weights - 1e-12:
                hi = mid
            else:
                lo = mid + 1
        self._largest_h = float(cands[lo])
        g, choices = costs.solve(self._largest_h)
        if not g < current.weights - 1e-12:
            self.complete = True
            return False
        self.points.append(costs.split(choices))
        self.complete = self.points[-1].weights <= self.result.least_weights + 1e-12
        return True

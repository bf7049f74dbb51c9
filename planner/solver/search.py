"""Best-first branch and bound over plan structures.

Search space, for every tensor-parallel degree and micro-batch size allowed:

  * at most one *mixed* class: n pipelines whose stages are a block of type A
    followed by a block of type B (A before B chosen too), and
  * for each device type, at most one *homogeneous* class: n pipelines of S
    stages of that type,

placed as `structure.place` describes, every class's layer split, recompute
and ZeRO choices optimal (`partition`), micro-batches shared optimally
(`evaluate.shares`). The objective is `evaluate`'s step time.

A node of the search tree fixes the mixed class and the classes of the first
few types; its bound is the time the global batch needs if every chosen class
ran at its lower bound and every open type ran its best class at a bound that
uses only per-layer times (no split does better). Nodes are expanded in order
of bound, so when the queue's best bound reaches the k-th best plan found, no
unexplored structure can beat it: the search is optimal. A time limit stops
the search early and reports the queue's best bound.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.errors import PlannerError
from planner.solver.evaluate import Config, Evaluation, Space, price, refine
from planner.solver.partition import class_costs, optimize
from planner.solver.structure import ClassShape, capacity
from planner.solver.table import CostTable
from planner.types import LinkSpec

SEARCH_SPACE = ("one optional two-type pipeline class plus one homogeneous class per device "
                "type; every tp and micro-batch size allowed; exact layer splits, recompute "
                "and ZeRO per stage; optimal micro-batch shares")


@dataclass(frozen=True)
class Limits:
    """What the user fixes or bounds (None: free)."""

    tp: int | None = None
    max_tp: int | None = None
    pp: int | None = None  # stages per pipeline
    dp: int | None = None  # number of pipelines
    micro_batch: int | None = None
    max_stages: int = 16
    max_micro_batch: int = 16
    mixed: bool = True


@dataclass
class SearchResult:
    best: list[Evaluation]
    status: str  # "optimal" or "feasible"
    bound: float
    explored: int
    pruned: int
    wall_time: float


@dataclass
class _Family:
    """Pipelines of one stage pattern, before choosing how many.

    min_busy and total start as bounds from per-layer times alone; `tight` marks
    that they were replaced by the class's exact first bottleneck and floor (at
    n_max pipelines, whose ZeRO sharding makes every split of fewer pipelines no
    faster)."""

    types: tuple[str, ...]
    n_max: int
    min_busy: float  # no split has a bottleneck below this
    total: float  # no split has a total below this
    tight: bool = False

    def lower(self, m: float) -> float:
        return (m - 1) * self.min_busy + self.total

    def capacity(self, t: float) -> float:
        """Micro-batches one pipeline can finish within t, at best."""
        return 0.0 if t < self.total else 1 + (t - self.total) / self.min_busy


@dataclass(order=True)
class _Node:
    bound: float
    order: int
    config: Config = field(compare=False)
    level: int = field(compare=False)  # 0: mixed class, then one level per type
    chosen: tuple[tuple[str, ...], ...] = field(compare=False)  # shapes' stage types
    counts: tuple[int, ...] = field(compare=False)
    # the last family may still shrink by one pipeline (its siblings are made lazily)
    fewer: frozenset = field(compare=False, default=frozenset())


def configs(table: CostTable, batch: int, limits: Limits) -> list[Config]:
    out = []
    tps = [t for t in table.tps if (limits.tp is None or t == limits.tp)
           and (limits.max_tp is None or t <= limits.max_tp)
           and any(d % t == 0 for info in table.types for d in info.node_devices)]
    mbs = [m for m in table.micro_batches if batch % m == 0
           and (limits.micro_batch is None or m == limits.micro_batch)
           and m <= max(limits.max_micro_batch, limits.micro_batch or 0)]
    for tp, mb in itertools.product(tps, mbs):
        out.append(Config(tp=tp, mb=mb))
    return out


def _families(table: CostTable, config: Config, limits: Limits, space: Space
              ) -> list[list[_Family]]:
    """Level 0: mixed patterns; level i: homogeneous patterns of type i.

    Each family starts with bounds from per-layer times alone: its stages of type
    k (c_k of them) share the work W_k the whole model takes on type k, so the
    bottleneck is at least 1 / sum_k (c_k / W_k) (the fluid bound) and at least
    the largest layer's time on its fastest type; the total is at least the
    smallest W_k. A family whose devices cannot hold the parameter states even
    fully sharded by ZeRO over its pipelines is dropped."""
    busy = {t.name: (lambda c: c.fwd + c.bwd)(table.costs(t.name, config.tp, config.mb))
            for t in table.types}
    work = {k: float(v.sum()) for k, v in busy.items()}
    slots = {t.name: sum(d // config.tp for d in t.node_devices) for t in table.types}
    longest = min(limits.max_stages, table.num_layers)
    params = float(table.params.sum()) / config.tp

    def state_bytes(n: int) -> float:
        """Fewest bytes per parameter a device can keep, with ZeRO over n pipelines."""
        shard = n if n > 1 else 1
        best = float("inf")
        for z in space.zeros:
            best = min(best, table.weight_bytes / (shard if z >= 3 else 1)
                       + table.grad_bytes / (shard if z >= 2 else 1)
                       + table.state_bytes / (shard if z >= 1 else 1))
        return best

    def family(types: tuple[str, ...]) -> _Family | None:
        blocks = [(k, len(list(g))) for k, g in itertools.groupby(types)]
        n_max = min(capacity(table, config.tp, k, c) for k, c in blocks)
        if n_max < 1:
            return None
        room = sum(c * (table.type(k).memory - table.type(k).reserve) for k, c in blocks)
        if room < params * state_bytes(n_max):
            return None
        per_layer = np.min([busy[k] for k, _ in blocks], axis=0)
        fluid = 1.0 / sum(c / work[k] for k, c in blocks)
        return _Family(types=types, n_max=n_max, total=min(work[k] for k, _ in blocks),
                       min_busy=max(fluid, float(per_layer.max())))

    def lengths() -> range:
        return range(limits.pp, limits.pp + 1) if limits.pp else range(1, longest + 1)

    levels: list[list[_Family]] = [[]]
    if limits.mixed and len(table.types) > 1:
        for a, b in itertools.permutations([t.name for t in table.types], 2):
            for total in lengths():
                for ca in range(1, min(total, slots[a] + 1)):
                    cb = total - ca
                    if 1 <= cb <= slots[b]:
                        f = family((a,) * ca + (b,) * cb)
                        if f is not None:
                            levels[0].append(f)
    for info in table.types:
        levels.append([f for s in lengths() if s <= slots[info.name]
                       and (f := family((info.name,) * s)) is not None])
    return levels


def _best_link(table: CostTable, a: str, b: str) -> LinkSpec:
    """The fastest link any stage of type a could have to a next stage of type b."""
    nodes_a, nodes_b = table.type(a).nodes, table.type(b).nodes
    links = [table.link(x, y) for x in nodes_a for y in nodes_b]
    fastest = max(links, key=lambda link: link.bandwidth)
    return LinkSpec(name=fastest.name, bandwidth=fastest.bandwidth,
                    latency=min(link.latency for link in links))


def _tighten(table: CostTable, config: Config, space: Space, family: _Family) -> None:
    """Replace the family's bounds by its exact split on optimistic terms, which no
    placement and no smaller count of its pipelines beats: ZeRO sharded over n_max
    pipelines (the most memory relief), the fastest links any placement could give,
    and ZeRO-3 gathers for free."""
    key = ("tight", family.types, family.n_max, config, space)
    if key not in table.cache:
        pairs = zip(family.types, family.types[1:], strict=False)
        links = [_best_link(table, a, b) for a, b in pairs]
        table.cache[key] = optimize(class_costs(
            table, family.types, tp=config.tp, mb=config.mb, n=family.n_max, links=links,
            gathers=[(0.0, 0.0)] * len(family.types), schedule=config.schedule,
            policies=space.policies, zeros=space.zeros))
    result = table.cache[key]
    family.tight = True
    if result is None:
        family.min_busy = family.total = float("inf")
    else:
        family.min_busy = max(family.min_busy, result.min_period)
        family.total = max(family.total, result.floor)


class _Bound:
    """Lower bounds on the step time of (partial) structures of one config.

    A pipeline of family f finishes at most 1 + (t - total_f) / min_busy_f
    micro-batches by time t (none before total_f), so n of them lie below the line
    n / min_busy_f * t + n * (1 - total_f / min_busy_f). An open level adds the
    best such line among its families, with n limited by the device slots the
    fixed classes left. The smallest t at which the lines reach the global
    number of micro-batches bounds the pipelines' time; the optimizer step of the
    fixed classes (some stage holds at least 1/S of the parameters) is added.
    """

    def __init__(self, levels: list[list[_Family]], microbatches: int,
                 slots: dict[str, int], optimizer: Callable[[_Family, int], float]) -> None:
        self.m, self.levels, self.slots, self.optimizer = microbatches, levels, slots, optimizer

    @staticmethod
    def _line(f: _Family, n: int) -> tuple[float, float]:
        return n / f.min_busy, n * (1 - f.total / f.min_busy)

    def __call__(self, fixed: Sequence[tuple[_Family, int]], open_levels: Sequence[int]
                 ) -> float:
        if sum(n for _, n in fixed) > self.m:
            return float("inf")
        used: dict[str, int] = {}
        for f, n in fixed:
            for kind in f.types:
                used[kind] = used.get(kind, 0) + n
        lines = [self._line(f, n) for f, n in fixed]
        for level in open_levels:
            best = (0.0, 0.0)
            for f in self.levels[level]:
                if f.min_busy == float("inf"):
                    continue
                n = min([f.n_max] + [(self.slots[k] - used.get(k, 0)) // f.types.count(k)
                                     for k in set(f.types)])
                if n > 0:
                    rate, offset = self._line(f, n)
                    best = (max(best[0], rate), max(best[1], offset))
            lines.append(best)
        rate = sum(r for r, _ in lines)
        if rate <= 0:
            return float("inf")
        start = max((f.total for f, _ in fixed), default=0.0)
        pipelines = max(start, (self.m - sum(c for _, c in lines)) / rate)
        return pipelines + max((self.optimizer(f, n) for f, n in fixed), default=0.0)


def search(table: CostTable, batch: int, *, limits: Limits | None = None,
           space: Space | None = None, top_k: int = 1, gap: float = 0.0,
           time_limit: float | None = None,
           progress: Callable[[int], None] | None = None) -> SearchResult:
    """The best `top_k` structures for a global batch of `batch` samples.

    gap: prune structures whose bound is within this fraction of the k-th best
    (0: exact); the returned bound accounts for what was pruned that way."""
    start = time.perf_counter()
    limits, space = limits or Limits(), space or Space()
    heap: list[_Node] = []
    counter = itertools.count()
    state: dict[Config, tuple[list[list[_Family]], _Bound, dict]] = {}
    params = float(table.params.sum())
    for config in configs(table, batch, limits):
        levels = _families(table, config, limits, space)
        slots = {t.name: sum(d // config.tp for d in t.node_devices) for t in table.types}

        def optimizer(f: _Family, n: int, tp: int = config.tp) -> float:
            shard = tp * len(f.types) * (n if max(space.zeros) >= 1 else 1)
            return min(table.optimizer_time(k, params / shard) for k in set(f.types))

        bound = _Bound(levels, batch // config.mb, slots, optimizer)
        index = {f.types: f for level in levels for f in level}
        state[config] = (levels, bound, index)
        root = bound([], range(len(levels)))
        heapq.heappush(heap, _Node(root, next(counter), config, 0, (), ()))
    best: list[Evaluation] = []
    explored = pruned = 0
    status = "optimal"
    given_up = float("inf")  # smallest bound pruned only because of `gap`

    def threshold() -> float:
        return best[top_k - 1].step_time if len(best) >= top_k else float("inf")

    def keep(b: float) -> bool:
        nonlocal given_up, pruned
        if b < threshold() * (1 - gap):
            return True
        if b < threshold():
            given_up = min(given_up, b)
        pruned += 1
        return False

    while heap:
        if time_limit is not None and time.perf_counter() - start > time_limit and best:
            status = "feasible"
            break
        node = heapq.heappop(heap)
        if not keep(node.bound):
            for rest in heap:
                keep(rest.bound)
            heap.clear()
            break
        levels, bound, index = state[node.config]
        fixed = [(index[t], n) for t, n in zip(node.chosen, node.counts, strict=True)]
        loose = [f for f, _ in fixed if not f.tight]
        if loose:  # price the families exactly, then look at the node again
            for f in loose:
                _tighten(table, node.config, space, f)
            node.bound = max(node.bound, bound(fixed, range(node.level, len(levels))))
            if keep(node.bound):
                heapq.heappush(heap, node)
            continue
        if node.counts and node.counts[-1] > 1 and node.chosen[-1] in node.fewer:
            # the same family with one pipeline fewer: no faster bound, so it waits
            counts = (*node.counts[:-1], node.counts[-1] - 1)
            b = bound([*fixed[:-1], (fixed[-1][0], counts[-1])],
                      range(node.level, len(levels)))
            if keep(b):
                heapq.heappush(heap, _Node(b, next(counter), node.config, node.level,
                                           node.chosen, counts, node.fewer))
        explored += 1
        if progress:
            progress(explored)
        if node.level == len(levels):
            _leaf(table, node, batch, limits, space, best, top_k)
            continue
        used: dict[str, int] = {}
        for f, n in fixed:
            for kind in f.types:
                used[kind] = used.get(kind, 0) + n
        children: list[tuple[_Family | None, int]] = [(None, 0)]
        for f in levels[node.level]:
            if f.min_busy == float("inf"):
                continue
            # at most as many pipelines as fit and as there are micro-batches left: the
            # bound only grows as a family loses pipelines, which the lazy siblings rely on
            n = min([f.n_max, bound.m - sum(node.counts)]
                    + [(bound.slots[k] - used.get(k, 0)) // f.types.count(k)
                       for k in set(f.types)])
            if n >= 1:
                children.append((f, n))
        for f, n in children:
            chosen = node.chosen + ((f.types,) if f else ())
            counts = node.counts + ((n,) if f else ())
            if node.level == len(levels) - 1 and not chosen:
                continue
            b = bound(fixed + ([(f, n)] if f else []), range(node.level + 1, len(levels)))
            if keep(b):
                heapq.heappush(heap, _Node(b, next(counter), node.config, node.level + 1,
                                           chosen, counts,
                                           frozenset([f.types]) if f else frozenset()))
    if not best:
        raise PlannerError(
            "infeasible", "No plan fits: every structure the search tried runs out of device "
            "memory or has more pipelines than micro-batches.",
            ["allow more pipeline stages (--max-stages) or recompute",
             "allow ZeRO (do not pass --zero 0)", "use a smaller --micro-batch",
             "add devices or use devices with more memory"])
    bound_value = min(best[0].step_time, given_up)
    if status != "optimal":
        bound_value = min([bound_value, *(n.bound for n in heap)])
    return SearchResult(best=best, status=status, bound=bound_value,
                        explored=explored, pruned=pruned,
                        wall_time=time.perf_counter() - start)


def _leaf(table: CostTable, node: _Node, batch: int, limits: Limits, space: Space,
          best: list[Evaluation], top_k: int) -> None:
    if limits.dp is not None and sum(node.counts) != limits.dp:
        return
    shapes = tuple(ClassShape(types=t, n=n) for t, n in zip(node.chosen, node.counts,
                                                           strict=True))
    microbatches = batch // node.config.mb
    priced = price(table, node.config, space, shapes, microbatches)
    if priced is None:
        return
    threshold = best[top_k - 1].step_time if len(best) >= top_k else float("inf")
    if priced.lower >= threshold:
        return
    evaluation = refine(table, priced, microbatches)
    if evaluation.step_time < threshold:
        best.append(evaluation)
        best.sort(key=lambda e: e.step_time)
        del best[top_k:]

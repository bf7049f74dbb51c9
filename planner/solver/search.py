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

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.errors import PlannerError
from planner.solver.evaluate import Config, Evaluation, Space, price, refine
from planner.solver.partition import ZERO_GATHER_REF, class_costs, optimize
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
    first_stage: str | None = None  # device type of every pipeline's first stage
    last_stage: str | None = None  # ... and of its last stage

    def allows(self, types: tuple[str, ...]) -> bool:
        """Whether a pipeline of these stage device types obeys the stage pins."""
        return ((self.first_stage is None or types[0] == self.first_stage)
                and (self.last_stage is None or types[-1] == self.last_stage))


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
        if not limits.allows(types):
            return None
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
    key = ("best link", a, b)
    if key not in table.cache:
        nodes_a, nodes_b = table.type(a).nodes, table.type(b).nodes
        links = [table.link(x, y) for x in nodes_a for y in nodes_b]
        fastest = max(links, key=lambda link: link.bandwidth)
        table.cache[key] = LinkSpec(name=fastest.name, bandwidth=fastest.bandwidth,
                                    latency=min(link.latency for link in links))
    return table.cache[key]


def _cheapest_gather(table: CostTable, kind: str) -> tuple[float, float]:
    """A ZeRO-3 all-gather no group of type-`kind` replicas beats: two ranks (the
    smallest group, moving half the bytes) over the fastest link of that type."""
    link = _best_link(table, kind, kind)
    intra = table.link(table.type(kind).nodes[0], table.type(kind).nodes[0])
    bandwidth = max(link.bandwidth, intra.bandwidth)
    latency = min(link.latency, intra.latency)
    return latency, latency + ZERO_GATHER_REF / (2 * bandwidth)


def _tighten(table: CostTable, config: Config, space: Space, family: _Family) -> None:
    """Replace the family's bounds by its exact split on optimistic terms, which no
    placement and no smaller count of its pipelines beats: ZeRO sharded over n_max
    pipelines (the most memory relief), the fastest links any placement could give,
    and the cheapest ZeRO-3 gathers any group could have."""
    key = ("tight", family.types, family.n_max, config, space)
    if key not in table.cache:
        pairs = zip(family.types, family.types[1:], strict=False)
        links = [_best_link(table, a, b) for a, b in pairs]
        table.cache[key] = optimize(class_costs(
            table, family.types, tp=config.tp, mb=config.mb, n=family.n_max, links=links,
            gathers=[_cheapest_gather(table, kind) for kind in family.types],
            schedule=config.schedule, policies=space.policies, zeros=space.zeros))
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
        self.kinds = sorted(slots)
        self._arrays: dict[int, tuple] = {}

    def _level(self, level: int) -> tuple:
        """Per family of a level: n_max, stages per type, min_busy, total (as arrays);
        `invalidate` drops them when families were tightened."""
        families = self.levels[level]
        cached = self._arrays.get(level)
        if cached is None:
            counts = np.array([[f.types.count(k) for k in self.kinds] for f in families],
                              dtype=float).reshape(len(families), len(self.kinds))
            cached = (None, np.array([f.n_max for f in families], dtype=float), counts,
                      np.array([f.min_busy for f in families]),
                      np.array([f.total for f in families]))
            self._arrays[level] = cached
        return cached[1:]

    def invalidate(self) -> None:
        self._arrays.clear()

    def _open_line(self, level: int, free: np.ndarray) -> tuple[float, float]:
        n_max, counts, busy, total = self._level(level)
        if not len(n_max):
            return 0.0, 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            fits = np.where(counts > 0, np.floor(free[None, :] / counts), np.inf).min(axis=1)
        n = np.minimum(n_max, fits)
        live = (n >= 1) & np.isfinite(busy)
        if not live.any():
            return 0.0, 0.0
        n, busy, total = n[live], busy[live], total[live]
        return float((n / busy).max()), float((n * (1 - total / busy)).max())

    @staticmethod
    def _line(f: _Family, n: int) -> tuple[float, float]:
        return n / f.min_busy, n * (1 - f.total / f.min_busy)

    def __call__(self, fixed: Sequence[tuple[_Family, int]], open_levels: Sequence[int]
                 ) -> float:
        if sum(n for _, n in fixed) > self.m:
            return float("inf")
        if any(f.min_busy == float("inf") for f, _ in fixed):
            return float("inf")
        free = np.array([float(self.slots[k]) for k in self.kinds])
        for f, n in fixed:
            for i, kind in enumerate(self.kinds):
                free[i] -= n * f.types.count(kind)
        lines = [self._line(f, n) for f, n in fixed]
        lines += [self._open_line(level, free) for level in open_levels]
        rate = sum(r for r, _ in lines)
        if rate <= 0:
            return float("inf")
        start = max((f.total for f, _ in fixed), default=0.0)
        pipelines = max(start, (self.m - sum(c for _, c in lines)) / rate)
        return pipelines + max((self.optimizer(f, n) for f, n in fixed), default=0.0)


def _optimizer_bound(table: CostTable, params: float, space: Space, tp: int
                     ) -> Callable[[_Family, int], float]:
    """The optimizer step n pipelines of family f pay at least: some stage holds 1/S of
    the parameters, sharded by ZeRO over the n pipelines if ZeRO is allowed."""
    memo: dict[tuple, float] = {}

    def bound(f: _Family, n: int) -> float:
        key = (f.types, n)
        if key not in memo:
            shard = tp * len(f.types) * (n if max(space.zeros) >= 1 else 1)
            memo[key] = min(table.optimizer_time(k, params / shard) for k in set(f.types))
        return memo[key]

    return bound


class _Search:
    """The state of one search: the queue, the best structures so far, the counters."""

    def __init__(self, table: CostTable, batch: int, limits: Limits, space: Space,
                 top_k: int, gap: float) -> None:
        self.table, self.batch, self.limits, self.space = table, batch, limits, space
        self.top_k, self.gap = top_k, gap
        self.heap: list[_Node] = []
        self.counter = itertools.count()
        self.state: dict[Config, tuple[list[list[_Family]], _Bound, dict]] = {}
        self.best: list[Evaluation] = []
        self.explored = self.pruned = 0
        self.given_up = float("inf")  # smallest bound pruned only because of `gap`
        params = float(table.params.sum())
        for config in configs(table, batch, limits):
            levels = _families(table, config, limits, space)
            slots = {t.name: sum(d // config.tp for d in t.node_devices) for t in table.types}

            bound = _Bound(levels, batch // config.mb, slots,
                           _optimizer_bound(table, params, space, config.tp))
            self.state[config] = (levels, bound, {f.types: f for lv in levels for f in lv})
            root = _Node(bound([], range(len(levels))), next(self.counter), config, 0, (), ())
            heapq.heappush(self.heap, root)

    def threshold(self) -> float:
        return self.best[self.top_k - 1].step_time if len(self.best) >= self.top_k else \
            float("inf")

    def keep(self, b: float) -> bool:
        if b < self.threshold() * (1 - self.gap):
            return True
        if b < self.threshold():
            self.given_up = min(self.given_up, b)
        self.pruned += 1
        return False

    def fixed(self, node: _Node) -> list[tuple[_Family, int]]:
        index = self.state[node.config][2]
        return [(index[t], n) for t, n in zip(node.chosen, node.counts, strict=True)]

    def settle(self, node: _Node) -> bool:
        """Price the node's families exactly; False if that raised its bound."""
        levels, bound, _ = self.state[node.config]
        fixed = self.fixed(node)
        loose = [f for f, _ in fixed if not f.tight]
        if not loose:
            return True
        for f in loose:
            _tighten(self.table, node.config, self.space, f)
        bound.invalidate()
        node.bound = max(node.bound, bound(fixed, range(node.level, len(levels))))
        return False

    def children(self, node: _Node) -> list[_Node]:
        levels, bound, _ = self.state[node.config]
        fixed = self.fixed(node)
        used: dict[str, int] = {}
        for f, n in fixed:
            for kind in f.types:
                used[kind] = used.get(kind, 0) + n
        options: list[tuple[_Family | None, int]] = [(None, 0)]
        for f in levels[node.level]:
            if f.min_busy == float("inf"):
                continue
            # at most as many pipelines as fit and as there are micro-batches left: the
            # bound only grows as a family loses pipelines, which the lazy siblings rely on
            n = min([f.n_max, bound.m - sum(node.counts)]
                    + [(bound.slots[k] - used.get(k, 0)) // f.types.count(k)
                       for k in set(f.types)])
            if n >= 1:
                options.append((f, n))
        out = []
        for f, n in options:
            chosen = node.chosen + ((f.types,) if f else ())
            if node.level == len(levels) - 1 and not chosen:
                continue
            b = bound(fixed + ([(f, n)] if f else []), range(node.level + 1, len(levels)))
            out.append(_Node(b, next(self.counter), node.config, node.level + 1, chosen,
                             node.counts + ((n,) if f else ()),
                             frozenset([f.types]) if f else frozenset()))
        return out

    def sibling(self, node: _Node) -> _Node | None:
        """The same last family with one pipeline fewer (made only when needed)."""
        if not (node.counts and node.counts[-1] > 1 and node.chosen[-1] in node.fewer):
            return None
        levels, bound, _ = self.state[node.config]
        fixed = self.fixed(node)
        counts = (*node.counts[:-1], node.counts[-1] - 1)
        b = bound([*fixed[:-1], (fixed[-1][0], counts[-1])], range(node.level, len(levels)))
        return _Node(b, next(self.counter), node.config, node.level, node.chosen, counts,
                     node.fewer)

    def is_leaf(self, node: _Node) -> bool:
        return node.level == len(self.state[node.config][0])

    def dive(self, node: _Node) -> None:
        """Follow the best child down to a leaf: a good plan early prunes the rest."""
        while True:
            while not self.settle(node):
                pass
            if node.bound == float("inf"):
                return
            if self.is_leaf(node):
                _leaf(self.table, node, self.batch, self.limits, self.space, self.best,
                      self.top_k)
                return
            children = self.children(node)
            while children:
                children.sort()
                if self.settle(children[0]):
                    break
            if not children or children[0].bound == float("inf"):
                return
            node = children[0]

    def step(self) -> bool:
        """Expand the most promising node; False when the search is over."""
        if not self.heap:
            return False
        node = heapq.heappop(self.heap)
        if not self.keep(node.bound):
            for rest in self.heap:
                self.keep(rest.bound)
            self.heap.clear()
            return False
        if not self.settle(node):
            if self.keep(node.bound):
                heapq.heappush(self.heap, node)
            return True
        sibling = self.sibling(node)
        if sibling is not None and self.keep(sibling.bound):
            heapq.heappush(self.heap, sibling)
        self.explored += 1
        if self.is_leaf(node):
            _leaf(self.table, node, self.batch, self.limits, self.space, self.best,
                  self.top_k)
            return True
        for child in self.children(node):
            if self.keep(child.bound):
                heapq.heappush(self.heap, child)
        return True


def search(table: CostTable, batch: int, *, limits: Limits | None = None,
           space: Space | None = None, top_k: int = 1, gap: float = 0.0,
           time_limit: float | None = None, dives: int = 3,
           seeds: Sequence[tuple[Config, tuple[ClassShape, ...]]] = (),
           progress: Callable[[int], None] | None = None) -> SearchResult:
    """The best `top_k` structures for a global batch of `batch` samples.

    gap: prune structures whose bound is within this fraction of the k-th best
    (0: exact); the returned bound accounts for what was pruned that way.
    dives: how many of the most promising configurations are first followed
    greedily to a plan, to start pruning with a good one.
    seeds: structures known to be good (e.g. the best on one device type), priced
    first for the same purpose."""
    start = time.perf_counter()
    run = _Search(table, batch, limits or Limits(), space or Space(), top_k, gap)
    for config, shapes in seeds:
        if config in run.state:
            node = _Node(0.0, next(run.counter), config, len(run.state[config][0]),
                         tuple(s.types for s in shapes), tuple(s.n for s in shapes))
            _leaf(table, node, batch, run.limits, run.space, run.best, top_k)
    for root in sorted(run.heap)[:dives]:
        run.dive(dataclasses.replace(root, order=next(run.counter)))
    status = "optimal"
    while run.step():
        if progress:
            progress(run.explored)
        if time_limit is not None and time.perf_counter() - start > time_limit and run.best:
            status = "feasible"
            break
    if not run.best:
        raise PlannerError(
            "infeasible", "No plan fits: every structure the search tried runs out of device "
            "memory or has more pipelines than micro-batches.",
            ["allow more pipeline stages (--max-stages) or recompute",
             "allow ZeRO (do not pass --zero 0)", "use a smaller --micro-batch",
             "add devices or use devices with more memory"])
    bound_value = min(run.best[0].step_time, run.given_up)
    if status != "optimal":
        bound_value = min([bound_value, *(n.bound for n in run.heap)])
    return SearchResult(best=run.best, status=status, bound=bound_value,
                        explored=run.explored, pruned=run.pruned,
                        wall_time=time.perf_counter() - start)


def _leaf(table: CostTable, node: _Node, batch: int, limits: Limits, space: Space,
          best: list[Evaluation], top_k: int) -> None:
    if limits.dp is not None and sum(node.counts) != limits.dp:
        return
    if not all(limits.allows(types) for types in node.chosen):
        return  # a seed the stage pins rule out
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
    if any((e.config, e.shapes) == (evaluation.config, evaluation.shapes) for e in best):
        return  # already found (by a dive)
    if evaluation.step_time < threshold:
        best.append(evaluation)
        best.sort(key=lambda e: e.step_time)
        del best[top_k:]

"""The search's structures as an assignment problem for CP-SAT, beside the branch and
bound of `search.py` (issue 53): which device groups form pipelines of which pattern.

For one configuration, with the families of `families.families` (a pipeline pattern
each: its blocks' types, stages and degrees, and floors of its period and fill), choose
n_f >= 0 pipelines of each family f (u_f: n_f > 0) such that

    sum_f n_f d_fk <= D_k                 the devices of each type k
    sum_{f homogeneous on k} u_f <= 1     one homogeneous class per type
    sum_{f mixed, k in f} u_f <= 1        mixed classes on disjoint sets of types
    sum_{f mixed} u_f <= M                at most M of them (`families.mixed_in`)
    sum_f n_f <= m                        a micro-batch per pipeline at least
    sum_f n_f c_f(T) >= m                 the global batch done by T

where c_f(T) = 1 + floor((T - s_f - total_f) / period_f) is the most micro-batches one
pipeline of f finishes by T (none before its fill), s_f what its own sync floor
(`sync_floor.SyncFloor`, the class alone at one pipeline) and optimizer floor add to a
step (`step.pipelines_within`): the step pays the largest of every class, so each class
finishes by T less its own. The least T for which a structure satisfies them
(`least_step`, a bisection on T, each step a CP-SAT feasibility problem) is a lower bound
on every structure of the configuration (it relaxes placement, links, shares and the
splits to their floors), and the structure CP-SAT returns there is priced exactly
(`evaluate.price`, `evaluate.refine`). A logic-based Benders loop (`assign_search`)
excludes each priced structure by a no-good cut, tightens the floors of the families a
returned structure uses first (`bound.tighten`, as the branch and bound settles a
node), and stops once no configuration's bound is below the best plan by more than the
gap: the same certificate as `search.search`, over the same space of structures of
several classes without ZeRO, 1F1B (`benchmarks/solve.py --cpsat` compares the two).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from planner.errors import PlannerError
from planner.solver.bound import optimizer_bound, tighten
from planner.solver.evaluate import Config, Evaluation, Space, price, refine
from planner.solver.families import Family, families, mixed_in, mixed_levels
from planner.solver.interleave import fold
from planner.solver.limits import Limits
from planner.solver.links import cheapest_gather
from planner.solver.partition import INF
from planner.solver.search import SearchResult, configs, degrees, placement_order, search_space
from planner.solver.step import pipelines_within
from planner.solver.structure import ClassShape
from planner.solver.sync_floor import SyncFloor
from planner.solver.table import CostTable
from planner.types import Schedule

_TICKS = 1e6  # CP-SAT's integers count microseconds
_PRECISION = 1e-4  # the bisection stops within this fraction of the least step


@dataclass
class Relaxed:
    """One configuration's families as the model sees them, and what the loop has
    learned of them: the structures priced (excluded by no-good cuts) and the least step
    the model allows (a bound on the others)."""

    config: Config
    families: list[Family]
    mixed: np.ndarray  # per family: whether it mixes types
    homes: np.ndarray  # per family: its type's index (-1 for a mixed one)
    devices: np.ndarray  # [family, type]: devices one pipeline takes
    extra: np.ndarray  # per family: what its sync and optimizer floors add to a step
    most_mixed: int  # the mixed classes a structure may have
    priced: list[dict[int, int]] = field(default_factory=list)  # family -> pipelines
    bound: float = 0.0  # no structure left is faster (`least_step`)
    witness: dict[int, int] | None = None  # a structure there


def relax(table: CostTable, config: Config, limits: Limits, space: Space, microbatches: int
          ) -> Relaxed:
    """The configuration's families (`families.families`, a structure of several
    classes runs without ZeRO), each with its sync floor alone at one pipeline and its
    optimizer floor (what every structure holding it pays at least)."""
    folded = fold(table, config.interleave)
    tps = degrees(table, limits) if config.tp is None else [config.tp]
    levels = families(folded, config, limits, space, microbatches, tps, split=True)
    most = mixed_in(levels[0], mixed_levels(folded, limits)) if levels else 0
    kinds = sorted(t.name for t in folded.types)
    unique = levels[:1] + levels[most:] if most else levels
    found = [f for level in unique for f in level if f.min_busy < INF and limits.allows(f.types)]
    sync = SyncFloor(folded, config, space, kinds,
                     {k: cheapest_gather(folded, k) for k in kinds}, tps, {})
    optimizer = optimizer_bound(folded, float(folded.params.sum()), space)
    extra = []
    for f in found:
        alone = sync.terms([(np.array([[k in f.types for k in kinds]]),
                             np.array([float(len(f.types))]), np.ones(1), np.ones(1),
                             sync.copies(f.types, f.tps)[None, :],
                             np.array([sync.tp_index(f.tps)]),
                             np.array([sync.runs(f.types, f.tps)]))])[0][0]
        extra.append(-pipelines_within(0.0, float(alone[0]), optimizer(f, f.n_max),
                                       folded.sync))
    mixed = np.array([len(set(f.types)) > 1 for f in found], dtype=bool)
    return Relaxed(
        config=config, families=found, mixed=mixed,
        homes=np.array([-1 if m else kinds.index(f.types[0]) for f, m in zip(
            found, mixed, strict=True)], dtype=int),
        devices=np.array([[f.devices_of(k) for k in kinds] for f in found],
                         dtype=float).reshape(len(found), len(kinds)),
        extra=np.array(extra), most_mixed=most)


def done_by(relaxed: Relaxed, step: float, microbatches: int) -> np.ndarray:
    """Per family, the most micro-batches one pipeline finishes in a step of `step`."""
    rows = relaxed.families
    with np.errstate(invalid="ignore"):  # (an infinite step: every micro-batch)
        ends = step - relaxed.extra - np.array([f.total for f in rows])
        busy = np.array([f.min_busy for f in rows])
        counts = np.where(ends >= 0, 1 + np.floor(np.maximum(ends, 0.0) / busy + 1e-9), 0.0)
    return np.minimum(np.nan_to_num(counts, nan=microbatches), microbatches).astype(int)


def structure_at(relaxed: Relaxed, step: float, table: CostTable, limits: Limits,
                 microbatches: int, threads: int = 1) -> dict[int, int] | None:
    """A structure (family -> pipelines) that may finish the global batch within a step
    of `step` and is not excluded, or None (CP-SAT: the constraints of the module)."""
    if not relaxed.families:
        return None
    model = cp_model.CpModel()
    done = done_by(relaxed, step, microbatches)
    n, used = [], []
    for f, family in enumerate(relaxed.families):
        n.append(model.NewIntVar(0, family.n_max, f"n{f}"))
        used.append(model.NewBoolVar(f"u{f}"))
        model.Add(n[f] >= 1).OnlyEnforceIf(used[f])
        model.Add(n[f] == 0).OnlyEnforceIf(used[f].Not())
    totals = {t.name: sum(t.node_devices) for t in table.types}
    for k, kind in enumerate(sorted(totals)):
        model.Add(sum(int(relaxed.devices[f, k]) * n[f] for f in range(len(n))
                      if relaxed.devices[f, k]) <= totals[kind])
        model.Add(sum(used[f] for f in np.flatnonzero(relaxed.homes == k)) <= 1)
        model.Add(sum(used[f] for f in np.flatnonzero(relaxed.mixed & (relaxed.devices[:, k]
                                                                       > 0))) <= 1)
    model.Add(sum(used[f] for f in np.flatnonzero(relaxed.mixed)) <= relaxed.most_mixed)
    model.Add(sum(used) >= 1)
    most = min(microbatches, limits.most_pipelines or microbatches)
    model.Add(sum(n) <= most)
    if limits.dp is not None:
        model.Add(sum(n) == limits.dp)
    model.Add(sum(int(done[f]) * n[f] for f in range(len(n)) if done[f]) >= microbatches)
    for structure in relaxed.priced:  # no-good: some family's count differs
        model.AddBoolOr(_differs(model, n, used, structure))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = threads
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return {f: int(solver.Value(n[f])) for f in range(len(n)) if solver.Value(n[f])}


def _differs(model: cp_model.CpModel, n: list, used: list, structure: dict[int, int]
             ) -> list:
    """Literals of which one holds where a structure is not `structure`: one of its
    families at another count, or another family used."""
    out = []
    for f, count in structure.items():
        same = model.NewBoolVar(f"same{f}_{count}")
        model.Add(n[f] == count).OnlyEnforceIf(same)
        model.Add(n[f] != count).OnlyEnforceIf(same.Not())
        out.append(same.Not())
    return out + [used[f] for f in range(len(n)) if f not in structure]


def least_step(relaxed: Relaxed, table: CostTable, limits: Limits, microbatches: int,
               high: float) -> None:
    """The least step the model allows (within `_PRECISION`; at least the bound found
    before: structures are only ever excluded and floors raised), and a structure
    there; infinite, and none, where no structure not excluded makes a step below
    `high` (the best plan so far: none could beat it)."""
    low = relaxed.bound
    if structure_at(relaxed, high, table, limits, microbatches) is None:
        relaxed.bound, relaxed.witness = INF if not np.isfinite(high) else high, None
        return
    while high - low > _PRECISION * high:
        middle = (low + high) / 2
        if structure_at(relaxed, middle, table, limits, microbatches) is None:
            low = middle
        else:
            high = middle
    relaxed.bound = low
    relaxed.witness = structure_at(relaxed, high, table, limits, microbatches)


def assign_search(table: CostTable, batch: int, *, limits: Limits | None = None,
                  space: Space | None = None, gap: float = 0.0,
                  time_limit: float | None = None) -> SearchResult:
    """The best structure of several classes without ZeRO, 1F1B, by the loop of the
    module: status, bound and gap as `search.search` reports them, over the same space
    (`benchmarks/solve.py --cpsat`)."""
    start = time.perf_counter()
    limits = dataclasses.replace(limits or Limits(), schedule=Schedule.ONE_F_ONE_B)
    space = dataclasses.replace(space or Space(), zeros=(0,))
    every = [c for c in configs(table, batch, limits) if c.interleave == 1]
    relaxed = [relax(table, c, limits, space, batch // c.mb) for c in every]
    best: Evaluation | None = None
    status, iterations = "optimal", 0
    for r in relaxed:
        least_step(r, table, limits, batch // r.config.mb, _ceiling(r, batch // r.config.mb))
    while relaxed:
        if time_limit is not None and time.perf_counter() - start > time_limit and best:
            status = "feasible"
            break
        upper = best.step_time if best else INF
        r = min(relaxed, key=lambda r: r.bound)
        if r.witness is None or r.bound >= upper * (1 - gap):
            break
        iterations += 1
        m = batch // r.config.mb
        loose = [r.families[f] for f in r.witness if not r.families[f].tight]
        for family in loose:  # (its floors rise: the bound may too)
            tighten(fold(table, r.config.interleave), r.config, space, family, m)
        if not loose:
            best = _priced(table, r, m, space, best) or best
            r.priced.append(r.witness)
        least_step(r, table, limits, m, best.step_time if best else _ceiling(r, m))
    if best is None:
        raise PlannerError("infeasible", "No structure of several classes without ZeRO "
                           "fits.")
    bound = min([best.step_time, *(r.bound for r in relaxed)])
    return SearchResult(best=[best], status=status, bound=bound, explored=iterations,
                        pruned=0, wall_time=time.perf_counter() - start,
                        space=search_space(table, batch, limits))


def _ceiling(relaxed: Relaxed, microbatches: int) -> float:
    """A step every structure of the configuration that can run makes in its model: its
    fill and every micro-batch on its slowest family's one pipeline."""
    if not relaxed.families:
        return INF
    return float(max(f.total + microbatches * f.min_busy for f in relaxed.families)
                 + relaxed.extra.max())


def _priced(table: CostTable, relaxed: Relaxed, microbatches: int, space: Space,
            best: Evaluation | None) -> Evaluation | None:
    """The witness priced exactly, where it beats `best`."""
    shapes = tuple(sorted((relaxed.families[f].shape(n) for f, n in relaxed.witness.items()),
                          key=placement_order))
    folded = fold(table, relaxed.config.interleave)
    priced = price(folded, relaxed.config, space, shapes, microbatches)
    if priced is None:
        return None
    found, _ = refine(folded, priced, microbatches, best.step_time if best else INF)
    return found


__all__ = ["ClassShape", "Relaxed", "assign_search", "least_step", "relax", "structure_at"]

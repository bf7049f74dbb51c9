"""Re-planning when nodes are lost, and plans with slack so that a loss costs only a
rebalance.

    result = replan(plan, lost=["cpu-1"])                 # a plan on what is left
    result.new, result.kept ("rebalance" or "search"), result.seconds, result.rows
    spare = spare_plan(graph, cluster, training, spare=0.2)   # slack that survives a loss

`replan` starts from the old plan (warm): its pipelines that no lost node touches, their
stages as they were and the global batch shared among them again (`rebalance`, priced as
written, no search), are the plan to beat; then the solver searches the cluster that is
left (plus any `add`ed nodes) within a short time limit, and its plan replaces the
rebalance only where it is faster. The search keeps to the constraints the plan was
solved with (`Plan.constraints`: --tp, --max-stages, --recompute, ...; an --exclude of a
lost node dropped) unless told to ignore them; the rebalance keeps the old stages, so it
keeps to them as well, except a --dp count of pipelines the loss leaves short. The
global batch is kept unless one is given: a run resumed under the new plan then trains
on the samples an uninterrupted run would have (`runtime/data.py` draws a step's samples
by their place in the global batch, whatever the plan), and its checkpoint reshards on
load (`runtime/checkpoint.py`).

A plan is resilient when losing any one node it uses leaves pipelines that can take the
whole global batch (`losses`: memory included). `spare_plan` returns the fastest resilient
plan among the solver's best plans (with every count of pipelines side by side) that is at
most `spare` slower than the best plan, so that a lost node costs a rebalance, not a
search and a new layout of the layers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.model import AnalyticalCostModel, CostModel
from planner.errors import PlannerError
from planner.types import (
    ClusterSpec,
    Layer,
    ModelGraph,
    PipelinePlan,
    Plan,
    Schedule,
    SolverReport,
    TrainingSpec,
)
from planner.types.plan import SolveConstraints

DEFAULT_TIME_LIMIT = 10.0  # seconds the search may take after a loss
SPARE_CANDIDATES = 8  # plans the solver returns per count of pipelines, for --spare
SAME_STEP = 1e-9  # relative: a searched plan this close to the rebalance is no faster


@dataclass(frozen=True)
class Rebalanced:
    """The old plan's surviving pipelines with the global batch shared among them again
    (None where that cannot run, `reason` saying why)."""

    plan: Plan | None
    reason: str = ""


@dataclass(frozen=True)
class Replan:
    """What `replan` found: the plan before and after, how the new one was found, and how
    long that took."""

    old: Plan
    new: Plan
    lost: tuple[str, ...]  # node names
    added: tuple[str, ...]  # names of the nodes `add` gave
    rebalanced: Rebalanced
    searched: Plan | None  # the solver's plan (None: its search found none)
    search_error: str  # why the search found none ("" where it did)
    kept: str  # "rebalance" or "search": which of the two `new` is
    seconds: float  # wall time of the whole re-plan
    # the constraints of the old plan's solve the search kept to (None: it recorded none,
    # or they were ignored), and the lost nodes whose --exclude was dropped from them
    constraints: SolveConstraints | None = None
    dropped: tuple[str, ...] = ()
    ignored: bool = False  # the plan's constraints were ignored (keep_constraints=False)

    @property
    def batch_changed(self) -> bool:
        return self.new.training.global_batch != self.old.training.global_batch


@dataclass(frozen=True)
class NodeLoss:
    """What losing one node of a plan costs with a rebalance alone."""

    node: str
    rebalanced: Rebalanced


@dataclass(frozen=True)
class Spare:
    """The plan `spare_plan` chose, the fastest plan found, and each node's loss."""

    plan: Plan
    best: Plan  # the fastest plan, resilient or not
    losses: tuple[NodeLoss, ...]  # of `plan`, one per node it uses

    @property
    def slack(self) -> float:
        """How much slower `plan` is than `best` (0.1: 10%)."""
        return self.plan.prediction.step_time / self.best.prediction.step_time - 1

    @property
    def worst(self) -> NodeLoss:
        """The node whose loss leaves the slowest rebalanced plan."""
        return max(self.losses, key=lambda loss: loss.rebalanced.plan.prediction.step_time
                   if loss.rebalanced.plan else float("inf"))


def _nodes_of(pipeline: PipelinePlan) -> set[str]:
    return {s.devices.node for s in pipeline.stages}


def used_nodes(plan: Plan) -> list[str]:
    """The nodes the plan runs on, in cluster order."""
    used = {node for p in plan.pipelines for node in _nodes_of(p)}
    return [n.name for n in plan.cluster.nodes if n.name in used]


def _report(step: float, seconds: float, what: str) -> SolverReport:
    """The report of a plan no search found (a rebalance): `what` says what it is."""
    return SolverReport(status="fixed", objective=step, best_bound=0.0, gap=0.0,
                        wall_time=seconds, lower_bound=0.0, explored=0, pruned=0,
                        search_space=what)


def rebalance(plan: Plan, cluster: ClusterSpec, layers: Sequence[Layer],
              costs: CostModel | None = None, *, global_batch: int | None = None) -> Rebalanced:
    """`plan`'s pipelines that run only on nodes of `cluster`, each stage as it was, the
    global batch (the plan's, or `global_batch`) shared among them so that the slowest
    finishes first (`solver.shares`, the solver's rule), priced as written; or why that
    cannot run (no pipeline survives, micro-batches of several sizes, too few of them, or
    a device's memory)."""
    from planner.price import price_plan
    from planner.solver.predict import stage_timings
    from planner.solver.shares import grouped_shares
    from planner.solver.timing import pipeline_time
    from planner.solver.uniform import overflows

    start = time.perf_counter()
    names = {n.name for n in cluster.nodes}
    kept = [p for p in plan.pipelines if _nodes_of(p) <= names]
    gone = sorted({n for p in plan.pipelines for n in _nodes_of(p)} - names)
    if not kept:
        return Rebalanced(None, f"every pipeline of the plan runs on {', '.join(gone)}")
    sizes = sorted({p.micro_batch for p in kept})
    if len(sizes) > 1:
        return Rebalanced(None, "its surviving pipelines run micro-batches of several sizes "
                          f"({', '.join(map(str, sizes))}), which one count cannot share")
    batch = global_batch or plan.training.global_batch
    if batch % sizes[0]:
        return Rebalanced(None, f"the global batch of {batch} is no whole number of its "
                          f"micro-batches of {sizes[0]}")
    training = dataclasses.replace(plan.training, global_batch=batch)
    draft = dataclasses.replace(
        plan, cluster=cluster, training=training, baselines=(),
        pipelines=tuple(dataclasses.replace(p, index=i) for i, p in enumerate(kept)))
    costs = costs or AnalyticalCostModel(cluster)
    lines, groups = [], []
    for pipeline, timings in zip(draft.pipelines, stage_timings(draft, layers, costs),
                                 strict=True):
        one = pipeline_time(timings, 1, schedule=pipeline.schedule,
                            interleave=pipeline.interleave)
        lines.append((1, one.period, one.fill))
        groups.append(len(pipeline.stages) if pipeline.schedule is Schedule.INTERLEAVED
                      else 1)
    counts = grouped_shares(lines, groups, batch // sizes[0])
    if counts is None:
        return Rebalanced(None, f"its {len(kept)} surviving pipeline(s) cannot share the "
                          f"{batch // sizes[0]} micro-batches of the global batch"
                          + (" in whole rounds of their stages (interleaved 1F1B)"
                             if any(g > 1 for g in groups) else ""))
    shared = dataclasses.replace(draft, pipelines=tuple(
        dataclasses.replace(p, batch_share=count * p.micro_batch, num_microbatches=count)
        for p, count in zip(draft.pipelines, counts, strict=True)))
    priced = price_plan(shared, layers, costs)
    over = overflows(priced.pipelines, cluster)
    if over:
        return Rebalanced(None, f"with the larger shares {over[0]}")
    what = ("the old plan's pipelines that " + (f"lost no node ({', '.join(gone)} lost)"
                                               if gone else "were kept")
            + ", the global batch shared among them again")
    return Rebalanced(dataclasses.replace(priced, solver=_report(
        priced.prediction.step_time, time.perf_counter() - start, what)))


def _check_lost(plan: Plan, lost: Sequence[str]) -> None:
    names = [n.name for n in plan.cluster.nodes]
    for name in lost:
        if name not in names:
            from planner.whatif import _unknown_node

            raise _unknown_node(plan.cluster, name)
    if len(set(lost)) != len(lost):
        twice = sorted({n for n in lost if list(lost).count(n) > 1})
        raise PlannerError("bad-option", f"--lost names {', '.join(twice)} more than once.",
                           ["name each lost node once"])


def replan(plan: Plan, *, lost: Sequence[str], add: Sequence[str] = (),
           global_batch: int | None = None, time_limit: float | None = DEFAULT_TIME_LIMIT,
           graph: ModelGraph | None = None, spare: float | None = None,
           keep_constraints: bool = True) -> Replan:
    """A new plan for `plan`'s model without the `lost` nodes and with the nodes `add`
    describes (`whatif.add_nodes` items, e.g. 1x8xA100-80G), warm-started from `plan`
    (see the module docstring); `graph`: the model as `explain.retrace` gives it (traced
    here if None); `spare`: the new plan must also survive any one node's loss by a
    rebalance, at most that much slower than the best (`spare_plan`);
    `keep_constraints`: keep to the constraints `plan` was solved with (False: search
    free). The new plan records the constraints its search kept to."""
    from planner import whatif
    from planner.constraints import dropped, solve_options, without_nodes
    from planner.explain import retrace
    from planner.solver import solve

    start = time.perf_counter()
    _check_lost(plan, lost)
    if not lost and not add and spare is None:
        raise PlannerError("bad-option", "Nothing to re-plan: name the lost nodes (--lost "
                           "NODE), nodes to add (--add SPEC) or the slack to keep (--spare F).",
                           [f"e.g. --lost {used_nodes(plan)[-1]}"])
    cluster = plan.cluster
    for spec in add:  # (before the removal: a new node never takes a lost one's name)
        cluster = whatif.add_nodes(cluster, spec)
    cluster = whatif.remove_nodes(cluster, list(lost)) if lost else cluster
    added = tuple(n.name for n in cluster.nodes if n.name not in
                  {m.name for m in plan.cluster.nodes})
    training = (whatif.edit_training(plan.training, global_batch=global_batch)
                if global_batch is not None else plan.training)
    recorded = plan.constraints if keep_constraints else None
    kept_to = None if recorded is None else without_nodes(recorded, lost)
    graph = graph or retrace(plan)
    costs = AnalyticalCostModel(cluster)
    rebalanced = _within(rebalance(plan, cluster, graph.layers, costs,
                                   global_batch=training.global_batch), kept_to)
    left = None if time_limit is None else max(0.0, time_limit - (time.perf_counter() - start))
    searched: Plan | None = None
    search_error = ""
    try:
        if spare is not None:  # (a rebalance need not be resilient: the search decides)
            searched = spare_plan(graph, cluster, training, spare=spare, time_limit=left,
                                  costs=costs, constraints=kept_to).plan
        else:
            try:
                searched = solve(graph, cluster, training, solve_options(
                    kept_to or SolveConstraints(), time_limit=left, top_k=1,
                    with_baselines=False), costs=costs)[0]
            except PlannerError as exc:  # (where the rebalance runs, it is the plan)
                if rebalanced.plan is None or exc.kind != "infeasible":
                    raise
                search_error = exc.message
    except PlannerError as exc:
        raise _under(exc, kept_to) from None
    # (each plan records the constraints its search kept to, for the next re-plan)
    record = kept_to or SolveConstraints()
    if searched is not None:
        searched = dataclasses.replace(searched, constraints=record)
    if rebalanced.plan is not None:
        rebalanced = Rebalanced(dataclasses.replace(rebalanced.plan, constraints=record))
    new, kept = (searched, "search") if searched is not None else (rebalanced.plan, "rebalance")
    if (spare is None and rebalanced.plan is not None and searched is not None
            and rebalanced.plan.prediction.step_time
            <= searched.prediction.step_time * (1 + SAME_STEP)):
        new, kept = rebalanced.plan, "rebalance"  # (--spare: only a resilient plan will do)
    assert new is not None
    return Replan(old=plan, new=new, lost=tuple(lost), added=added, rebalanced=rebalanced,
                  searched=searched, search_error=search_error, kept=kept,
                  seconds=time.perf_counter() - start, constraints=kept_to,
                  dropped=() if recorded is None else dropped(recorded, lost),
                  ignored=not keep_constraints and plan.constraints is not None)


def _within(rebalanced: Rebalanced, constraints: SolveConstraints | None) -> Rebalanced:
    """The rebalance where it keeps to `constraints` (it keeps the old stages, so only a
    --dp count of pipelines can fail), else why not."""
    if (rebalanced.plan is None or constraints is None or constraints.dp is None
            or len(rebalanced.plan.pipelines) == constraints.dp):
        return rebalanced
    return Rebalanced(None, f"the plan was solved with --dp {constraints.dp} and "
                      f"{len(rebalanced.plan.pipelines)} pipeline(s) survive")


def _under(exc: PlannerError, constraints: SolveConstraints | None) -> PlannerError:
    """`exc` saying that the search kept to the plan's constraints, and how to drop them
    (as is where it kept to none)."""
    from planner.constraints import flags

    given = flags(constraints)
    if not given:
        return exc
    return PlannerError(exc.kind, f"{exc.message} (The re-plan keeps to the constraints "
                        f"the plan was solved with: {given}.)",
                        [*exc.remedies, "re-plan without them: --ignore-constraints"])


def losses(plan: Plan, layers: Sequence[Layer]) -> tuple[NodeLoss, ...]:
    """For each node `plan` uses, the plan a rebalance leaves when that node is lost (or
    why there is none)."""
    from planner.whatif import remove_nodes

    out = []
    for node in used_nodes(plan):
        if len(plan.cluster.nodes) == 1:
            out.append(NodeLoss(node, Rebalanced(None, "it is the plan's only node")))
            continue
        cluster = remove_nodes(plan.cluster, [node])
        out.append(NodeLoss(node, rebalance(plan, cluster, layers)))
    return tuple(out)


def resilient(found: Sequence[NodeLoss]) -> bool:
    return all(loss.rebalanced.plan is not None for loss in found)


def spare_plan(graph: ModelGraph, cluster: ClusterSpec, training: TrainingSpec, *,
               spare: float, time_limit: float | None = DEFAULT_TIME_LIMIT,
               costs: CostModel | None = None,
               constraints: SolveConstraints | None = None) -> Spare:
    """The fastest plan that survives the loss of any one node it uses by a rebalance
    and is at most `spare` (a fraction: 0.2 for 20%) slower than the fastest plan found;
    candidates: the solver's best plans free and with each count of pipelines side by
    side from 2 to the number of nodes (the time limit shared among those searches),
    all keeping to `constraints` (a --dp of theirs fixes the count, a --max-dp bounds it)."""
    from planner.constraints import solve_options
    from planner.solver import solve

    if not 0 <= spare < 1:
        raise PlannerError("bad-option", f"--spare is a fraction of the best plan's speed "
                           f"to give up for slack, in [0, 1) (got {spare:g}).",
                           ["e.g. --spare 0.2: up to 20% slower"])
    base = solve_options(constraints or SolveConstraints(), top_k=SPARE_CANDIDATES,
                         with_baselines=False)
    most = min(len(cluster.nodes), training.global_batch,
               base.limits.most_pipelines or len(cluster.nodes))
    counts = [None, *range(2, most + 1)] if base.limits.dp is None else [None]
    each = None if time_limit is None else time_limit / len(counts)
    plans: list[Plan] = []
    for dp in counts:
        options = dataclasses.replace(base, time_limit=each, limits=base.limits if dp is None
                                      else dataclasses.replace(base.limits, dp=dp))
        try:
            plans += solve(graph, cluster, training, options, costs=costs)
        except PlannerError as exc:  # (no plan of that many pipelines)
            if exc.kind not in ("infeasible", "bad-option") or dp is None:
                raise
    ranked = sorted(plans, key=lambda p: p.prediction.step_time)
    best = ranked[0]
    weighed = []
    for plan in ranked:
        if plan.prediction.step_time > best.prediction.step_time * (1 + spare):
            break
        found = losses(plan, graph.layers)
        weighed.append(plan)
        if resilient(found):
            return Spare(plan=plan, best=best, losses=found)
    cheapest = _cheapest_resilient(ranked[len(weighed):], graph.layers)
    needs = ("; none of the plans found is resilient" if cheapest is None else
             "; the fastest resilient plan found is "
             f"{cheapest / best.prediction.step_time - 1:.1%} slower than the best")
    raise PlannerError(
        "no-spare", f"No plan within --spare {spare:g} (at most {spare:.0%} slower than the "
        f"best plan's {best.prediction.step_time:.4g} s per step) survives the loss of any "
        f"one of its nodes by a rebalance: in each of the {len(weighed)} such plan(s) some "
        f"node's loss leaves no pipeline that can take the global batch{needs}.",
        ["allow more slack with a larger --spare" if cheapest is not None else
         "plan on more nodes: a resilient plan needs pipelines that avoid each node",
         "or plan without --spare and re-plan after a loss (planner replan --lost NODE)"])


def _cheapest_resilient(plans: Sequence[Plan], layers: Sequence[Layer]) -> float | None:
    """The step time of the fastest resilient plan among `plans` (None: none is)."""
    for plan in plans:  # (fastest first)
        if resilient(losses(plan, layers)):
            return plan.prediction.step_time
    return None

"""The strategy report (`planner compare --strategies MODEL -c CLUSTER`): the ways teams
usually train a model, side by side with the solver's best hybrid plan, on one cluster
and priced by one set of rules.

    plan = solve(graph, cluster, hybrid_training(training))[0]
    report = strategy_report(graph, cluster, training, hybrid=plan, interval=8)
    row = report.rows[0]                  # DDP
    row.best.plan.prediction.samples_per_s, row.curve   # its fastest point, 1..N replicas

  DDP            every device a replica, even shares of the batch (as DDP runs them),
                 gradient sums overlapping backward
  FSDP ZeRO-2    the same, gradients and optimizer state sharded over the replicas
  FSDP ZeRO-3    the same, weights sharded too (gathered for each micro-batch)
  local SGD:H    every device a replica, shares in proportion to speed (capacity-
                 proportional local steps), parameters averaged every H steps,
                 weighted by share
  DiLoCo:H       the same, an outer Nesterov step on the averaged change every H steps
  hybrid         the solver's best plan (tp, pp, dp; uneven layers and shares), gradient
                 sums overlapping backward

Each data-parallel strategy is laid out as `planner estimate --tp 1 --pp 1` lays out a
recipe (`uniform.uniform_pipelines`, devices fastest type first: `baselines.by_speed`)
and priced by `build.assemble`, the solver's own `predict` and step model
(`solver/step.py`: overlap, 1/H of a sync); shares in proportion to speed are the
solver's rule (`replan.rebalance`, priced by `price.price_plan`). So every row is a plan
that `launch` can run and `explain` prices to the same figures: no formula of its own.

A strategy is priced at 1, 2, 4, ... replicas and on every device (the scaling curve);
at each count it takes the fastest micro-batch size with the cheapest recompute policy
that fits (`MICRO_BATCHES`, `Recompute` order), and its row is its fastest point. Where
no layout fits a device's memory, the point keeps the one that overflows least, and
says which device needs how much. ZeRO over replicas of several device types has no
point (the runtime shards among the replicas of one type, so it would be DDP under
another name). The hybrid's curve keeps the solver's plan's first
1, 2, 4, ... pipelines (largest shares first), the global batch shared among them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.model import AnalyticalCostModel, CostModel
from planner.errors import Infeasible, PlannerError
from planner.sync import MAX_INTERVAL, convergence_risk
from planner.types import ClusterSpec, Layer, ModelGraph, Plan, Recompute, SyncSpec, TrainingSpec

MICRO_BATCHES = (1, 2, 4, 8)  # the micro-batch sizes a data-parallel strategy tries
DEFAULT_INTERVAL = 8  # steps between syncs of local SGD and DiLoCo, unless --interval
OVERLAPPED = SyncSpec(overlap=True)  # every-step sums overlapping backward (DDP, FSDP)
HYBRID = "hybrid (solver)"


@dataclass(frozen=True)
class Strategy:
    """A data-parallel way to train: one replica per device, its ZeRO stage, its sync
    and how the batch is shared."""

    name: str
    description: str
    zero: int
    sync: SyncSpec
    speed_shares: bool  # shares in proportion to speed (`replan.rebalance`), else even


def data_parallel_strategies(interval: int) -> tuple[Strategy, ...]:
    """DDP, FSDP ZeRO-2 and ZeRO-3, local SGD and DiLoCo every `interval` steps."""
    check_interval(interval)
    even = "one replica per device, even shares"
    return (
        Strategy("DDP", f"{even}, sums overlapping backward", 0, OVERLAPPED, False),
        Strategy("FSDP ZeRO-2", f"{even}, gradients and optimizer state sharded", 2,
                 OVERLAPPED, False),
        Strategy("FSDP ZeRO-3", f"{even}, weights, gradients and optimizer state sharded",
                 3, OVERLAPPED, False),
        Strategy(f"local SGD:{interval}", "one replica per device, shares by speed, "
                 f"parameters averaged every {interval} steps",
                 0, SyncSpec(mode="local-sgd", interval=interval), True),
        Strategy(f"DiLoCo:{interval}", "one replica per device, shares by speed, an outer "
                 f"Nesterov step every {interval} steps",
                 0, SyncSpec(mode="diloco", interval=interval), True),
    )


def check_interval(interval: int) -> None:
    if not 1 <= interval <= MAX_INTERVAL:
        raise PlannerError("bad-option", f"--interval must be between 1 and {MAX_INTERVAL} "
                           f"steps between syncs (got {interval}).",
                           [f"--interval {DEFAULT_INTERVAL}"])


@dataclass(frozen=True)
class Point:
    """A strategy at one count of replicas: its fastest layout that fits, else the one
    that overflows least (`fits` False, `reason` naming the device), or None where
    none could be laid out (`reason` says why: too small a batch, ...)."""

    replicas: int
    plan: Plan | None
    fits: bool
    reason: str = ""


@dataclass(frozen=True)
class StrategyRow:
    """A strategy: its fastest point that fits (else its point that overflows least, or
    one without a plan) and its scaling curve."""

    name: str
    description: str
    best: Point
    curve: tuple[Point, ...]


@dataclass(frozen=True)
class Figures:
    """What the report shows of a strategy's plan."""

    step_time: float
    samples_per_s: float
    tokens_per_s: float | None
    peak_memory: float  # bytes, the most any device of the plan holds
    capacity: float  # that device's memory
    peak_device: str  # its device type
    comm_seconds: float  # a step's communication, the busiest device of each kind
    comm_bytes: float  # (the sync: what a step pays of it, `figures`)
    whole_sync: float  # one whole gradient sync (or average), paid 1/H of per step
    risk: str  # `sync.convergence_risk`


@dataclass(frozen=True)
class StrategyReport:
    model: str
    cluster: str
    global_batch: int
    interval: int
    rows: tuple[StrategyRow, ...]


def replica_counts(most: int) -> list[int]:
    """1, 2, 4, ... below `most`, and `most`: the points of a scaling curve."""
    counts, count = [], 1
    while count < most:
        counts.append(count)
        count *= 2
    return [*counts, most]


def _overflow(plan: Plan) -> float:
    """The largest share of its device's memory a stage of `plan` needs."""
    return max(s.memory.total / plan.cluster.node(s.devices.node).device.memory
               for p in plan.pipelines for s in p.stages)


def _layout(strategy: Strategy, replicas: int, micro_batch: int, recompute: Recompute,
            graph: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
            costs: CostModel) -> tuple[Plan, str]:
    """The strategy on the `replicas` fastest devices, priced, and why it cannot run
    ("" where it can): a device whose memory overflows, or shares by speed that cannot
    be given (`replan.rebalance`'s reason). PlannerError where it cannot be laid out,
    ZeRO over replicas of several device types included (a recipe shards none there,
    `uniform.py`, so it would be DDP under another name)."""
    from planner.replan import rebalance
    from planner.solver.build import FIXED, assemble
    from planner.solver.uniform import overflows, uniform_pipelines

    training = dataclasses.replace(training, sync=strategy.sync)
    pipelines = uniform_pipelines(layers=graph.layers, cluster=cluster, training=training,
                                  costs=costs, tp=1, pp=1, dp=replicas, micro_batch=micro_batch,
                                  recompute=recompute, zero=strategy.zero)
    assert pipelines is not None  # (without must_fit, a layout is always returned)
    if strategy.zero and any(s.zero != strategy.zero for p in pipelines for s in p.stages):
        kinds = sorted({s.device_type for p in pipelines for s in p.stages})
        raise PlannerError("bad-option", f"{replicas} replicas mix {' and '.join(kinds)}, and "
                           "ZeRO shards only among replicas of one device type (the runtime's "
                           "FSDP groups)")
    plan = assemble(model=graph.spec, training=training, cluster=cluster, pipelines=pipelines,
                    layers=graph.layers, costs=costs, solver=FIXED)
    if over := overflows(plan.pipelines, cluster):
        return plan, over[0]
    if not strategy.speed_shares:
        return plan, ""
    shared = rebalance(plan, cluster, graph.layers, costs)
    if shared.plan is None:
        return plan, f"shares by speed cannot be given: {shared.reason}"
    return shared.plan, ""


def _point(strategy: Strategy, replicas: int, graph: ModelGraph, cluster: ClusterSpec,
           training: TrainingSpec, costs: CostModel) -> Point:
    """The strategy at `replicas`: each micro-batch size with the cheapest recompute
    policy that fits, the fastest of them."""
    fitting: list[Plan] = []
    closest: tuple[Plan, str] | None = None
    why = ""
    for micro_batch in MICRO_BATCHES:
        if training.global_batch % micro_batch:
            continue
        for recompute in Recompute:
            try:
                plan, problem = _layout(strategy, replicas, micro_batch, recompute, graph,
                                        cluster, training, costs)
            except PlannerError as exc:
                why = why or exc.message
                break
            if not problem:
                fitting.append(plan)
                break
            if closest is None or _overflow(plan) < _overflow(closest[0]):
                closest = (plan, problem)
    if fitting:
        return Point(replicas, min(fitting, key=lambda p: p.prediction.step_time), True)
    if closest is not None:
        return Point(replicas, closest[0], False, closest[1])
    return Point(replicas, None, False, why)


def best_point(curve: Sequence[Point]) -> Point:
    """The fastest point that fits; else the one that overflows least; else the last."""
    fitting = [p for p in curve if p.fits and p.plan is not None]
    if fitting:
        return min(fitting, key=lambda p: p.plan.prediction.step_time)  # type: ignore[union-attr]
    priced = [p for p in curve if p.plan is not None]
    if priced:
        return min(priced, key=lambda p: _overflow(p.plan))  # type: ignore[arg-type]
    return curve[-1]


def data_parallel_row(strategy: Strategy, graph: ModelGraph, cluster: ClusterSpec,
                      training: TrainingSpec, costs: CostModel | None = None) -> StrategyRow:
    """The strategy at every count of `replica_counts` of the cluster's devices, fastest
    type first."""
    from planner.solver.baselines import by_speed

    cluster = by_speed(cluster, training.dtype)
    costs = costs or AnalyticalCostModel(cluster)
    curve = tuple(_point(strategy, count, graph, cluster, training, costs)
                  for count in replica_counts(cluster.num_devices))
    return StrategyRow(strategy.name, strategy.description, best_point(curve), curve)


def hybrid_row(plan: Plan, layers: Sequence[Layer], costs: CostModel | None = None
               ) -> StrategyRow:
    """The solver's plan, and its first 1, 2, 4, ... pipelines (largest shares first)
    with the global batch shared among them again (`replan.rebalance`)."""
    from planner.replan import rebalance
    from planner.solver.uniform import overflows

    costs = costs or AnalyticalCostModel(plan.cluster)
    order = sorted(plan.pipelines, key=lambda p: -p.batch_share)
    curve = []
    for count in replica_counts(len(order)):
        if count == len(order):
            curve.append(Point(count, plan, not overflows(plan.pipelines, plan.cluster)))
            continue
        fewer = dataclasses.replace(plan, pipelines=tuple(order[:count]))
        shared = rebalance(fewer, plan.cluster, layers, costs)
        curve.append(Point(count, shared.plan, shared.plan is not None, shared.reason))
    shape = plan.pipelines[0]
    description = (f"the solver's plan: {len(plan.pipelines)} pipeline(s) of "
                   f"{len(shape.stages)} stage(s), tp {shape.stages[0].tp}, "
                   f"{plan.training.sync.describe()}")
    return StrategyRow(HYBRID, description, curve[-1], tuple(curve))


def figures(plan: Plan, layers: Sequence[Layer], costs: CostModel | None = None) -> Figures:
    """The report's figures of `plan`: the prediction's throughput, the largest stage
    memory, and its communication as `explain.traffic` counts it, the busiest row of
    each kind (ZeRO-3's gathers included, which the prediction counts in compute); of
    the gradient sync, what a step pays (`prediction.dp_comm`: less what backward hides,
    1/H of it every H steps) and the bytes it sends once in H steps (`step.exposed`)."""
    from planner.explain import traffic
    from planner.solver.step import exposed

    costs = costs or AnalyticalCostModel(plan.cluster)
    prediction = plan.prediction
    stages = [s for p in plan.pipelines for s in p.stages]
    peak = max(stages, key=lambda s: s.memory.total)
    device = plan.cluster.node(peak.devices.node).device
    busiest: dict[str, tuple[float, float]] = {}  # kind: bytes, seconds
    for row in traffic(plan, layers, costs):
        nbytes, seconds = busiest.get(row.kind, (0.0, 0.0))
        busiest[row.kind] = (max(nbytes, row.bytes_per_step), max(seconds, row.seconds))
    once_in = dataclasses.replace(plan.training.sync, overlap=False)  # (bytes, not time)
    if SYNC_KIND in busiest:
        busiest[SYNC_KIND] = (exposed(busiest[SYNC_KIND][0], 0.0, once_in), prediction.dp_comm)
    whole = prediction.dp_comm if prediction.whole_sync is None else prediction.whole_sync
    return Figures(
        step_time=prediction.step_time, samples_per_s=prediction.samples_per_s,
        tokens_per_s=prediction.tokens_per_s, peak_memory=peak.memory.total,
        capacity=device.memory, peak_device=device.name,
        comm_seconds=sum(seconds for _, seconds in busiest.values()),
        comm_bytes=sum(nbytes for nbytes, _ in busiest.values()), whole_sync=whole,
        risk=convergence_risk(plan))


SYNC_KIND = "dp all-reduce"  # `explain.traffic`'s rows of the gradient sync


def hybrid_training(training: TrainingSpec) -> TrainingSpec:
    """The training the hybrid plan is solved for: sums overlapping backward, as DDP's."""
    return dataclasses.replace(training, sync=OVERLAPPED)


def strategy_report(graph: ModelGraph, cluster: ClusterSpec, training: TrainingSpec, *,
                    hybrid: Plan | Infeasible, interval: int = DEFAULT_INTERVAL
                    ) -> StrategyReport:
    """Every data-parallel strategy (`data_parallel_strategies`) beside `hybrid`, the
    solver's plan for `hybrid_training(training)` (the CLI runs the solver under its
    progress display), or the Infeasible error it ended with: a row that says why."""
    rows = [data_parallel_row(s, graph, cluster, training)
            for s in data_parallel_strategies(interval)]
    if isinstance(hybrid, Infeasible):
        last = StrategyRow(HYBRID, "the solver's plan", Point(0, None, False, hybrid.message), ())
    else:
        last = hybrid_row(hybrid, graph.layers)
    return StrategyReport(model=graph.spec.describe(), cluster=cluster.name,
                          global_batch=training.global_batch, interval=interval,
                          rows=(*rows, last))

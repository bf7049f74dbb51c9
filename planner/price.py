"""Pricing a plan as written: its stages' modules and memory and its step time by cause,
from the plan's own layout, whoever wrote it.

    priced = price_file(Path("mine.json"))        # read (figures may be left out), traced
    priced.plan.prediction.step_time              # ... and priced
    price_plan(plan, layers, costs)               # a Plan in hand, priced again

The solver prices the plans it builds by the same rules (`solver.build.stage_plan`,
`solver.predict.predict`), so a plan written by hand prices to the figures the solver
gives a plan of the same structure, and a solver's plan edited after the solve prices
to figures of its own, never to the stale ones in its file. `planner estimate --plan`
(alias `planner price`) and `planner explain` price plan files this way; benchmarks price
hand-written and peer planners' plans with `price_plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cost_models.model import AnalyticalCostModel, CostModel
from planner.errors import PlannerError
from planner.solver.predict import Holders, predict
from planner.solver.timing import in_flight
from planner.types import (
    CostBreakdown,
    DeviceSpec,
    Layer,
    MemoryBreakdown,
    ModelGraph,
    PipelinePlan,
    Plan,
    Recompute,
    Schedule,
    SolverReport,
    StagePlan,
    TrainingSpec,
)
from planner.types.model import zero_kept

# a step time this close to the one a plan file holds is the same price (float noise)
SAME_PRICE = 1e-9


@dataclass(frozen=True)
class PricedPlan:
    """A plan file priced: the plan with its figures, its model's trace and the cost
    model that priced it (to price or simulate more with)."""

    plan: Plan
    graph: ModelGraph
    costs: CostModel


def check_layers(plan: Plan, layers: Sequence[Layer], source: str = "") -> None:
    """A clear error when the plan's stages do not match the model's layers (the model
    or its code changed since the plan was made, or a plan written by hand runs another
    number of layers), naming `source` if given."""
    where = f"{source}: " if source else ""
    for p in plan.pipelines:
        for s in p.stages:
            held = [layer for a, b in s.chunks for layer in layers[a:b]]
            end = max(b for _, b in s.chunks)
            modules = tuple(m for layer in held for m in layer.modules)
            if end > len(layers) or (s.modules and modules != tuple(s.modules)):
                raise PlannerError(
                    "plan-mismatch", where
                    + f"The plan's stage {s.index} of pipeline {p.index} holds "
                    f"layers {s.layers[0]}-{s.layers[1] - 1}, which do not match model "
                    f"{plan.model.describe()} as it traces now ({len(layers)} layers); the "
                    "model or its code changed since the plan was made.",
                    ["solve again with `planner solve` for the model as it is now"])
        end = max(b for s in p.stages for _, b in s.chunks)
        if end < len(layers):
            raise PlannerError(
                "plan-mismatch", where
                + f"Pipeline {p.index} runs layers 0-{end - 1}, but model "
                f"{plan.model.describe()} has {len(layers)} layers (0-{len(layers) - 1}); "
                "every pipeline runs the whole model.",
                [f"give pipeline {p.index}'s last stage the layers up to {len(layers)} "
                 "(stage layers are [start, end): `planner trace "
                 f"{plan.model.name}` lists them)"])


def replicas(plan: Plan) -> dict[tuple, int]:
    """How many stages of the plan hold each stage's layers on its device type and tp
    (`Holders.key`): its ZeRO group, over which memory is sharded."""
    counts: dict[tuple, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            counts[Holders.key(s)] = counts.get(Holders.key(s), 0) + 1
    return counts


def stage_memory(plan: Plan, pipeline: PipelinePlan, stage: StagePlan, layers: Sequence[Layer],
                 costs: CostModel, *, replicas: int, recompute: Recompute | None = None,
                 zero: int | None = None) -> MemoryBreakdown:
    """Bytes per device of `stage` of `pipeline` (`held_memory`), sharded over its
    `replicas`; `recompute` or `zero` price it with another policy or ZeRO stage
    (explain: without a saver)."""
    return held_memory(
        [layers[i] for i in stage.held()], layers, plan.cluster.node(stage.devices.node).device,
        plan.training, costs, tp=stage.tp, replicas=replicas,
        zero=stage.zero if zero is None else zero,
        recompute=stage.recompute if recompute is None else recompute,
        micro_batch=pipeline.micro_batch, stage=stage.index, stages=len(pipeline.stages),
        microbatches=pipeline.num_microbatches, schedule=pipeline.schedule,
        interleave=pipeline.interleave)


def held_memory(held: Sequence[Layer], layers: Sequence[Layer], device: DeviceSpec,
                training: TrainingSpec, costs: CostModel, *, tp: int, replicas: int, zero: int,
                recompute: Recompute, micro_batch: int, stage: int, stages: int,
                microbatches: int, schedule: Schedule, interleave: int) -> MemoryBreakdown:
    """Bytes per device of the `stage`-th of `stages` holding the layers `held` (of the
    model's `layers`): `costs.memory` with the micro-batches its schedule holds in flight
    at its peak, the tied weights ZeRO keeps whole, sharded over its `replicas`. The one
    rule for plans priced as written (`stage_memory`) and the solver's
    (`solver.build.stage_plan`)."""
    return costs.memory(
        held, device, training, tp=tp, dp=replicas, zero=zero, recompute=recompute,
        micro_batch=micro_batch,
        in_flight=in_flight(stage, stages, microbatches, schedule, interleave),
        kept=zero_kept(layers, {layer.index for layer in held}, zero))


def price_plan(plan: Plan, layers: Sequence[Layer], costs: CostModel | None = None) -> Plan:
    """`plan` priced as written: each stage's modules and memory, the step time by cause
    (`predict`); `layers` are its model's as its training runs them (`explain.retrace`).
    A search result priced to another step time than its file holds (it was edited after
    the solve) is no longer the search's: its report becomes a fixed plan's, as the
    search's status, bound and gap were about the plan it returned."""
    check_layers(plan, layers)
    costs = costs or AnalyticalCostModel(plan.cluster)
    counts = replicas(plan)
    pipelines = tuple(dataclasses.replace(p, stages=tuple(dataclasses.replace(
        s, modules=tuple(m for i in s.held() for m in layers[i].modules),
        memory=stage_memory(plan, p, s, layers, costs, replicas=counts[Holders.key(s)]))
        for s in p.stages)) for p in plan.pipelines)
    draft = dataclasses.replace(plan, pipelines=pipelines)
    prediction = predict(draft, layers, costs)
    return dataclasses.replace(draft, prediction=prediction,
                               solver=_report(plan, prediction))


def _report(plan: Plan, prediction: CostBreakdown) -> SolverReport:
    """The solver report of `plan` priced at `prediction`: the search's own where the
    file holds that price, else a fixed plan's (see `price_plan`)."""
    solver, step = plan.solver, prediction.step_time
    stored = plan.prediction.step_time
    if solver.status == "fixed" or abs(stored - step) <= SAME_PRICE * step:
        return solver
    return SolverReport(status="fixed", objective=step, best_bound=0.0, gap=0.0,
                        wall_time=0.0, lower_bound=0.0, explored=0, pruned=0,
                        search_space=f"priced again: the file's plan, from a {solver.status} "
                        f"search, priced {stored:.6g} s per step (edited since, or priced "
                        "by another cost model)")


def price_file(path: Path) -> PricedPlan:
    """The plan in `path` as written (the figures pricing gives may be left out:
    `planfile.read_plan(written=True)`), its model traced again and checked against its
    stages (`explain.retrace`), priced by `price_plan`; a plan without a sequence length
    takes its model's."""
    from planner.explain import retrace  # (explain imports this module)
    from planner.planfile import read_plan

    plan = read_plan(path, written=True)
    graph = retrace(plan, str(path))
    if plan.training.seq_len is None and graph.seq_len is not None:
        plan = dataclasses.replace(plan, training=dataclasses.replace(
            plan.training, seq_len=graph.seq_len))
    costs = AnalyticalCostModel(plan.cluster)
    return PricedPlan(plan=price_plan(plan, graph.layers, costs), graph=graph, costs=costs)

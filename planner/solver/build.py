"""Turn a priced structure into a Plan: stages on concrete devices, memory, predictions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cost_models.model import CostModel
from planner.solver.evaluate import Evaluation
from planner.solver.predict import predict
from planner.solver.timing import in_flight
from planner.types import (
    SCHEMA_VERSION,
    ClusterSpec,
    CostBreakdown,
    DeviceGroup,
    Layer,
    ModelSpec,
    PipelinePlan,
    Plan,
    Schedule,
    SolverReport,
    StagePlan,
    TrainingSpec,
)
from planner.types.training import Recompute


def stage_plan(*, index: int, layers: Sequence[Layer], bounds: tuple[int, int],
               chunks: tuple[tuple[int, int], ...] | None = None, node: str, slot: int,
               device_type: str, tp: int, recompute: Recompute, zero: int, replicas: int,
               micro_batch: int, microbatches: int, stages: int, schedule: Schedule,
               interleave: int, training: TrainingSpec, cluster: ClusterSpec,
               costs: CostModel) -> StagePlan:
    chunks = chunks or (bounds,)
    held = [layer for a, b in chunks for layer in layers[a:b]]
    device = cluster.node(node).device
    memory = costs.memory(held, device, training, tp=tp, dp=replicas, zero=zero,
                          recompute=recompute, micro_batch=micro_batch,
                          in_flight=in_flight(index, stages, microbatches, schedule,
                                              interleave))
    return StagePlan(index=index, layers=bounds, chunks=chunks,
                     modules=tuple(m for layer in held for m in layer.modules),
                     device_type=device_type,
                     devices=DeviceGroup(node=node, devices=tuple(range(slot * tp,
                                                                        (slot + 1) * tp))),
                     tp=tp, recompute=recompute, zero=zero, memory=memory)


PENDING = SolverReport(status="pending", objective=0.0, best_bound=0.0, gap=0.0, wall_time=0.0,
                       lower_bound=0.0, explored=0, pruned=0, search_space="")
FIXED = SolverReport(status="fixed", objective=0.0, best_bound=0.0, gap=0.0, wall_time=0.0,
                     lower_bound=0.0, explored=0, pruned=0, search_space="fixed by the user")


def assemble(*, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
             pipelines: Sequence[PipelinePlan], layers: Sequence[Layer], costs: CostModel,
             solver: SolverReport = PENDING) -> Plan:
    """A Plan with its predictions computed by `predict`."""
    draft = Plan(schema_version=SCHEMA_VERSION, model=model, training=training,
                 cluster=cluster, pipelines=tuple(pipelines),
                 prediction=_EMPTY, solver=solver)
    return dataclasses.replace(draft, prediction=predict(draft, layers, costs))


_EMPTY = CostBreakdown(step_time=0.0, compute=0.0, bubble=0.0, tp_comm=0.0, pp_comm=0.0,
                       dp_comm=0.0, optimizer=0.0, samples_per_s=0.0, tokens_per_s=None,
                       mfu=0.0)


def from_evaluation(evaluation: Evaluation, *, model: ModelSpec, training: TrainingSpec,
                    cluster: ClusterSpec, layers: Sequence[Layer], costs: CostModel,
                    solver: SolverReport = PENDING) -> Plan:
    config = evaluation.config
    pipelines: list[PipelinePlan] = []
    for shape, slots, split, counts in zip(evaluation.shapes, evaluation.placement,
                                           evaluation.splits, evaluation.microbatches,
                                           strict=True):
        for pipe_slots, m in zip(slots, counts, strict=True):
            stages = tuple(
                stage_plan(index=s, layers=layers,
                           bounds=(split.bounds[s], split.bounds[s + 1]),
                           node=pipe_slots[s].node, slot=pipe_slots[s].index,
                           device_type=shape.types[s], tp=config.tp,
                           recompute=split.options[s].recompute, zero=split.options[s].zero,
                           replicas=shape.n, micro_batch=config.mb, microbatches=m,
                           stages=shape.stages, schedule=config.schedule, interleave=1,
                           training=training, cluster=cluster, costs=costs)
                for s in range(shape.stages))
            pipelines.append(PipelinePlan(index=len(pipelines), stages=stages,
                                          batch_share=m * config.mb, micro_batch=config.mb,
                                          num_microbatches=m, schedule=config.schedule))
    return assemble(model=model, training=training, cluster=cluster, pipelines=pipelines,
                    layers=layers, costs=costs, solver=solver)

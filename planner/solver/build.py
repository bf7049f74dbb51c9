"""Turn a priced structure into a Plan: stages on concrete devices, memory, predictions."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence

from cost_models.model import CostModel
from planner.solver.evaluate import Evaluation
from planner.solver.interleave import chunks
from planner.solver.predict import grad_syncs, predict
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
               chunks: tuple[tuple[int, int], ...] | None = None, node: str, first: int,
               device_type: str, tp: int, recompute: Recompute, zero: int, replicas: int,
               micro_batch: int, microbatches: int, stages: int, schedule: Schedule,
               interleave: int, training: TrainingSpec, cluster: ClusterSpec,
               costs: CostModel) -> StagePlan:
    from planner.price import held_memory  # (planner.price reads the solver's predictions)

    chunks = chunks or (bounds,)
    held = [layer for a, b in chunks for layer in layers[a:b]]
    memory = held_memory(held, layers, cluster.node(node).device, training, costs, tp=tp,
                         replicas=replicas, zero=zero, recompute=recompute,
                         micro_batch=micro_batch, stage=index, stages=stages,
                         microbatches=microbatches, schedule=schedule, interleave=interleave)
    return StagePlan(index=index, layers=bounds, chunks=chunks,
                     modules=tuple(m for layer in held for m in layer.modules),
                     device_type=device_type,
                     devices=DeviceGroup(node=node, devices=tuple(range(first, first + tp))),
                     tp=tp, recompute=recompute, zero=zero, memory=memory)


PENDING = SolverReport(status="pending", objective=0.0, best_bound=0.0, gap=0.0, wall_time=0.0,
                       lower_bound=0.0, explored=0, pruned=0, search_space="")
FIXED = SolverReport(status="fixed", objective=0.0, best_bound=0.0, gap=0.0, wall_time=0.0,
                     lower_bound=0.0, explored=0, pruned=0, search_space="fixed by the user")


def assemble(*, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
             pipelines: Sequence[PipelinePlan], layers: Sequence[Layer], costs: CostModel,
             solver: SolverReport = PENDING) -> Plan:
    """A Plan with its stages' gradient syncs chosen (`grad_syncs`) and its predictions
    computed by `predict`."""
    draft = grad_syncs(Plan(schema_version=SCHEMA_VERSION, model=model, training=training,
                            cluster=cluster, pipelines=tuple(pipelines),
                            prediction=_EMPTY, solver=solver), layers, costs)
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
        # a split of the folded table (`interleave.py`); one stage holds every chunk,
        # which is plain 1F1B
        v = config.interleave if shape.stages > 1 else 1
        schedule = config.schedule if v > 1 or config.gpipe else Schedule.ONE_F_ONE_B
        held = [chunks((split.bounds[s], split.bounds[s + 1]), len(layers),
                       config.interleave) for s in range(shape.stages)]
        if v == 1:
            held = [((h[0][0], h[-1][1]),) for h in held]
        for pipe_slots, m in zip(slots, counts, strict=True):
            stages = tuple(
                stage_plan(index=s, layers=layers, bounds=(held[s][0][0], held[s][-1][1]),
                           chunks=held[s], node=pipe_slots[s].node, first=pipe_slots[s].first,
                           device_type=shape.types[s], tp=shape.tps[s],
                           recompute=split.options[s].recompute, zero=split.options[s].zero,
                           replicas=shape.n, micro_batch=config.mb, microbatches=m,
                           stages=shape.stages, schedule=schedule, interleave=v,
                           training=training, cluster=cluster, costs=costs)
                for s in range(shape.stages))
            pipelines.append(PipelinePlan(index=len(pipelines), stages=stages,
                                          batch_share=m * config.mb, micro_batch=config.mb,
                                          num_microbatches=m, schedule=schedule,
                                          interleave=v))
    return assemble(model=model, training=training, cluster=rank_order(cluster, pipelines),
                    pipelines=pipelines, layers=layers, costs=costs, solver=solver)


def rank_order(cluster: ClusterSpec, pipelines: Sequence[PipelinePlan]) -> ClusterSpec:
    """The cluster with its nodes in an order that puts every interleaved pipeline's
    stages on ascending ranks (torch's interleaved 1F1B needs that, and ranks follow
    the plan's node order, `runtime.layout`): each stage's node before the next
    stage's, other nodes as they were. Placement crosses nodes in one direction only
    (a type's nodes in order, type A before type B in a mixed pipeline), so such an
    order exists; the cluster is returned as it is where it already fits."""
    after: dict[str, set[str]] = {}
    for p in pipelines:
        if p.interleave > 1:
            for a, b in itertools.pairwise(s.devices.node for s in p.stages):
                if a != b:
                    after.setdefault(a, set()).add(b)
    position = {n.name: i for i, n in enumerate(cluster.nodes)}
    if all(position[a] < position[b] for a, nexts in after.items() for b in nexts):
        return cluster
    waiting = {n.name: 0 for n in cluster.nodes}
    for nexts in after.values():
        for b in nexts:
            waiting[b] += 1
    ready = [position[name] for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:  # Kahn's topological sort, the cluster's order among the ready ones
        node = cluster.nodes[heapq.heappop(ready)]
        order.append(node)
        for b in after.get(node.name, ()):
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, position[b])
    if len(order) < len(cluster.nodes):
        return cluster  # a cycle (no such order): the runtime says which pipeline
    return dataclasses.replace(cluster, nodes=tuple(order))

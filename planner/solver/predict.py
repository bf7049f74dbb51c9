"""Predictions for a concrete plan: per-stage timings, step time by cause, memory.

This prices a `Plan` (from the solver, `estimate`, a baseline or a plan file)
with the cost model, by the same rules the search uses on its cost table:

  * a stage's busy time is its layers' forward and backward, tensor-parallel
    all-reduces inside its node, recomputation, and for ZeRO-3 three gathers of
    its weights among its replicas per micro-batch;
  * a stage's replicas are the stages of other pipelines with the same layers,
    device type and tp (its ZeRO group);
  * gradients of each stage are all-reduced among every pipeline holding its
    first layer (ZeRO-3 stages reduce-scatter per micro-batch instead), all at once,
    those of a node's stages one after the other on its network card;
  * the step from the slowest pipeline (`timing.pipeline_time`), gradient sync and
    optimizer step as `step.py` combines them, the sync paid as the plan's
    `training.sync` says (after the schedule, overlapping the last backward, or every
    H steps).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cost_models.comm import Collective, CommGroup, busiest_card, send_sharing, shared_by
from cost_models.compute import recompute_repeats_tp
from cost_models.model import CostModel
from planner.data.loading import input_rates, loading_seconds, plan_feeds
from planner.dtypes import dtype_bytes
from planner.solver.partition import ZERO_GATHER_REF
from planner.solver.step import (
    Contention,
    device_contention,
    last_bucket,
    overlappable,
    step_time,
    worst,
)
from planner.solver.structure import wider_than_neighbours
from planner.solver.timing import PipelineTime, StageTiming, pipeline_time
from planner.types import (
    CostBreakdown,
    Layer,
    NodeSpec,
    PipelinePlan,
    Plan,
    Schedule,
    StagePlan,
    SyncAlgorithm,
)
from planner.types.model import params_per_rank, zero_kept

if TYPE_CHECKING:
    from planner.simulate import Simulation


class Holders:
    """Who holds what: a stage's replicas (its ZeRO group) and a layer's holders."""

    def __init__(self, plan: Plan) -> None:
        self.replicas: dict[tuple, list[str]] = {}
        self.stages = [s for p in plan.pipelines for s in p.stages]
        for s in self.stages:
            self.replicas.setdefault(self.key(s), []).append(s.devices.node)
        self._holders: dict[int, list[str]] = {}

    @staticmethod
    def key(stage: StagePlan) -> tuple:
        return stage.layers, stage.device_type, stage.tp

    def of(self, stage: StagePlan) -> list[str]:
        return self.replicas[self.key(stage)]

    def holders(self, layer: int) -> list[str]:
        if layer not in self._holders:
            self._holders[layer] = [s.devices.node for s in self.stages if s.holds(layer)]
        return self._holders[layer]


def _split_ties(layers: Sequence[Layer], groups: Holders
                ) -> list[tuple[int, tuple[int, ...], int, list[str]]]:
    """(owner, readers, parameters, holders) of each tied weight some stage holds part
    of (the owner or a reader without the rest): its gradient is summed over every stage
    holding the owner or a reader, in an all-reduce of its own
    (`evaluate.sync_and_optimizer` alike)."""
    readers: dict[tuple[int, int], list[int]] = {}
    for layer in layers:
        for owner, weights in layer.tied:
            readers.setdefault((owner, weights), []).append(layer.index)
    out = []
    for (owner, weights), tied in readers.items():
        ends = (owner, *tied)
        holding = [s for s in groups.stages if any(s.holds(i) for i in ends)]
        if any(not all(s.holds(i) for i in ends) for s in holding):
            out.append((owner, tuple(tied), weights, [s.devices.node for s in holding]))
    return out


def pipeline_sends(pipeline: PipelinePlan) -> list[tuple[StagePlan, StagePlan, list[int]]]:
    """Each send of a micro-batch's activations: (sender, receiver, the layers whose
    outputs it sends, one per chunk). A stage sends each chunk's output to the next
    stage; interleaved, the last stage sends each round's output but the final one's
    back to the first stage (the wrap-around, `timing.py`)."""
    stages = pipeline.stages
    out = [(a, b, [end - 1 for _, end in a.chunks]) for a, b in itertools.pairwise(stages)]
    if pipeline.schedule is Schedule.INTERLEAVED and len(stages) > 1 and len(
            stages[-1].chunks) > 1:
        out.append((stages[-1], stages[0], [end - 1 for _, end in stages[-1].chunks[:-1]]))
    return out


def plan_send_sharing(plan: Plan) -> dict[str, int]:
    """`send_sharing` of every send of the plan's pipelines."""
    return send_sharing((a.devices.node, b.devices.node, min(a.tp, b.tp))
                        for p in plan.pipelines for a, b, _ in pipeline_sends(p))


def stage_timings(plan: Plan, layers: Sequence[Layer], costs: CostModel
                  ) -> list[list[StageTiming]]:
    """Seconds per micro-batch of every stage of every pipeline."""
    cluster, dtype = costs.cluster, plan.training.dtype
    groups = Holders(plan)
    out = []
    compute: dict[tuple, tuple[float, float, float, float]] = {}  # stages repeat across replicas
    gathers: dict[tuple, float] = {}  # one ZeRO-3 group's gather
    flows = plan_send_sharing(plan)
    for pipeline in plan.pipelines:
        mb, timings = pipeline.micro_batch, []
        sends = {a.index: (b, outputs) for a, b, outputs in pipeline_sends(pipeline)}
        for stage, leads in zip(pipeline.stages, lead_layers(pipeline), strict=True):
            lead_in, lead_out = (lead_broadcast(stage, layer, layers, mb, costs)
                                 for layer in leads)
            node = cluster.node(stage.devices.node)
            # a stage's tensor-parallel group lies inside its node: nodes with the same
            # device and intra-node link price it alike
            key = (stage.chunks, id(node.device), node.intra_link, stage.tp, mb,
                   stage.recompute)
            if key not in compute:
                chunk_layers = [layers[i] for i in stage.held()]
                compute[key] = _compute(chunk_layers, node, stage, mb, dtype, costs)
            fwd, bwd, tp_fwd, recompute = compute[key]
            if stage.zero == 3:
                if (zero := (groups.key(stage), stage.chunks)) not in gathers:
                    gathers[zero] = _gather(plan, layers, stage, groups, costs)
                fwd += gathers[zero]
                bwd += 2 * gathers[zero]
            send = 0.0
            if stage.index in sends:
                # interleaved: each chunk's output goes on; the closed form takes the largest
                receiver, outputs = sends[stage.index]
                sent = max(layers[i].output_bytes for i in outputs)
                after = receiver.devices.node
                send = costs.p2p_time(sent * mb * shared_by(flows, node.name, after),
                                      node.name, after)
            timings.append(StageTiming(fwd=fwd + lead_in, bwd=bwd + lead_out,
                                       tp_fwd=tp_fwd + lead_in, tp_bwd=tp_fwd + lead_out,
                                       recompute=recompute, send=send))
        out.append(timings)
    return out


def lead_layers(pipeline: PipelinePlan) -> list[tuple[int | None, int | None]]:
    """Per stage, the layers whose outputs its first rank broadcasts per micro-batch to
    its other tensor-parallel ranks (`runtime/follow.py`; None: none): where the stage
    is wider than the one before, each forward's input (the layer before it); wider
    than the one after, each backward's output gradient (its last layer's output)."""
    stages = pipeline.stages
    return [(stage.layers[0] - 1 if before else None, stage.layers[1] - 1 if after else None)
            for stage, (before, after) in zip(
                stages, wider_than_neighbours([s.tp for s in stages]), strict=True)]


def lead_broadcast(stage: StagePlan, layer: int | None, layers: Sequence[Layer], mb: int,
                   costs: CostModel) -> float:
    """Seconds of one such broadcast of `layer`'s output (`partition.class_costs` alike:
    none for no bytes)."""
    if layer is None or not layers[layer].output_bytes:
        return 0.0
    return costs.collective_time(Collective.BROADCAST, layers[layer].output_bytes * mb,
                                 CommGroup(((stage.devices.node, stage.tp),)))


def _gather(plan: Plan, layers: Sequence[Layer], stage: StagePlan, groups: Holders,
            costs: CostModel) -> float:
    """Seconds of one ZeRO-3 all-gather of a stage's weights among its replicas (but
    the tied weights it owns: ZeRO-3 keeps them whole); interleaved, each chunk
    gathers its own: a latency per chunk (as `partition._gathers`)."""
    group = CommGroup.of(groups.of(stage))
    held = stage.held()
    owned = {(owner, params) for layer in layers for owner, params in layer.tied
             if stage.holds(owner)}
    weight = (sum(layers[i].params for i in held) - sum(p for _, p in owned)
              ) * plan_weight_bytes(plan)
    g0 = costs.collective_time(Collective.ALL_GATHER, 1.0, group)
    g1 = costs.collective_time(Collective.ALL_GATHER, ZERO_GATHER_REF, group)
    return (len(stage.chunks) * g0 + (g1 - g0) * weight / ZERO_GATHER_REF) if weight else 0.0


def _compute(chunk_layers: Sequence[Layer], node: NodeSpec, stage: StagePlan, mb: int,
             dtype: str, costs: CostModel) -> tuple[float, float, float, float]:
    """(forward, backward, tensor-parallel, recompute) seconds of a stage's layers per
    micro-batch; forward and backward include the tensor-parallel collectives, and a
    full recompute runs them again (`table.build_table` alike)."""
    fwd = bwd = tp_fwd = recompute = 0.0
    group = CommGroup(((node.name, stage.tp),))
    again = recompute_repeats_tp(stage.recompute)
    for layer in chunk_layers:
        t = costs.layer_time(layer, node.device, tp=stage.tp, micro_batch=mb, dtype=dtype)
        tp_comm = costs.tp_comm_time(layer, mb, group) if stage.tp > 1 else 0.0
        rec = costs.recompute_time(layer, node.device, tp=stage.tp, micro_batch=mb,
                                   dtype=dtype, policy=stage.recompute) + tp_comm * again
        fwd += t.fwd + tp_comm
        bwd += t.bwd + tp_comm + rec
        tp_fwd += tp_comm
        recompute += rec
    return fwd, bwd, tp_fwd, recompute


def plan_weight_bytes(plan: Plan) -> float:
    return float(dtype_bytes(plan.training.dtype))


def own_sync(stage: StagePlan, layers: Sequence[Layer], groups: Holders,
             ties: Sequence[tuple[int, tuple[int, ...], int, CommGroup]], grad: float
             ) -> tuple[float, CommGroup] | None:
    """The bytes of a stage's all-reduce of its own gradients (its parameters but the
    split ties' it owns: they have theirs) and its group, every stage holding its first
    layer; None where ZeRO-3 shards them within one class (each shard is summed across
    classes only)."""
    shard = len(groups.of(stage)) if stage.zero >= 1 else 1
    holders = groups.holders(stage.layers[0])
    if stage.zero == 3 and len(holders) <= shard:
        return None
    params = sum(layers[i].params for i in stage.held()) - sum(
        weights for owner, _, weights, _ in ties if stage.holds(owner))
    return params * grad / (shard if stage.zero == 3 else 1), CommGroup.of(holders)


def _sync_inputs(plan: Plan, layers: Sequence[Layer]
                 ) -> tuple[float, Holders, list[tuple[int, tuple[int, ...], int, CommGroup]]]:
    """(gradient bytes per parameter, the holders, the split ties with their groups)."""
    groups = Holders(plan)
    ties = [(owner, readers, weights, CommGroup.of(holders))
            for owner, readers, weights, holders in _split_ties(layers, groups)]
    return plan.training.optimizer.grad_bytes or plan_weight_bytes(plan), groups, ties


def grad_syncs(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> Plan:
    """`plan` with each stage's `grad_sync`: the algorithm of the all-reduce of its own
    gradients as priced (`sync_and_optimizer`), where the runtime sums them itself (no
    ZeRO: FSDP's reductions are its own); ring elsewhere."""
    grad, groups, ties = _sync_inputs(plan, layers)

    def chosen(stage: StagePlan) -> SyncAlgorithm:
        own = own_sync(stage, layers, groups, ties, grad)
        if own is None or stage.zero:
            return SyncAlgorithm.RING
        return costs.collective_choice(Collective.ALL_REDUCE, *own).algorithm

    return dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(s, grad_sync=chosen(s))
                                             for s in p.stages))
        for p in plan.pipelines))


def sync_and_optimizer(plan: Plan, layers: Sequence[Layer], costs: CostModel
                       ) -> tuple[float, float]:
    grad, groups, ties = _sync_inputs(plan, layers)
    # each distinct all-reduce: its group and time (`evaluate.sync_and_optimizer`)
    synced: dict[tuple, tuple[CommGroup, float]] = {
        ("tie", i): (group, costs.collective_time(Collective.ALL_REDUCE, weights * grad, group))
        for i, (_, _, weights, group) in enumerate(ties)}
    charges: list[tuple[str, tuple, CommGroup, float]] = []  # see `busiest_card`
    seen: set[tuple] = set()
    sync = opt = 0.0
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            key = (groups.key(stage), stage.zero, stage.devices.node)
            if key in seen:  # a replica on the same node costs the same
                continue
            seen.add(key)
            shard = len(groups.of(stage)) if stage.zero >= 1 else 1
            # the stage's all-reduces: split ties', then its own
            mine: list[tuple] = [("tie", i) for i, (owner, readers, _, _) in enumerate(ties)
                                 if any(stage.holds(j) for j in (owner, *readers))]
            if (own := own_sync(stage, layers, groups, ties, grad)) is not None:
                volume, group = own
                if (stage.layers[0], volume) not in synced:  # the same group on every node
                    synced[stage.layers[0], volume] = (group, costs.collective_time(
                        Collective.ALL_REDUCE, volume, group))
                mine.append((stage.layers[0], volume))
            sync = max(sync, sum(synced[k][1] for k in mine))
            charges += [(stage.devices.node, k, *synced[k]) for k in mine]
            device = costs.cluster.node(stage.devices.node).device
            # the optimizer updates the stage's copies of tied weights too, whole where
            # ZeRO keeps them so
            held = stage.held()
            kept = zero_kept(layers, set(held), stage.zero)
            local = params_per_rank([layers[i] for i in held], stage.tp)
            opt = max(opt, costs.optimizer_time((local - kept) / shard + kept, device,
                                                plan.training))
    return max(sync, busiest_card(charges)), opt


def tail_sync(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> float:
    """The all-reduce of the last bucket (`step.last_bucket`) of the stage whose is the
    longest, where `plan`'s sync overlaps backward (0 elsewhere): priced as the stage's
    whole sum is (`sync_and_optimizer`), on its group."""
    sync = plan.training.sync
    if not sync.overlap:
        return 0.0
    grad, groups, ties = _sync_inputs(plan, layers)
    owns = [own_sync(stage, layers, groups, ties, grad) for p in plan.pipelines
            for stage in p.stages]
    return max((costs.collective_time(Collective.ALL_REDUCE,
                                      last_bucket(volume, sync.bucket_mb), group)
                for volume, group in filter(None, owns)), default=0.0)


def pipeline_times(plan: Plan, timings: Sequence[Sequence[StageTiming]]
                   ) -> list[PipelineTime]:
    return [pipeline_time(t, p.num_microbatches, schedule=p.schedule, interleave=p.interleave)
            for p, t in zip(plan.pipelines, timings, strict=True)]


def replay(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> Simulation:
    """The event-driven simulation of one step of `plan`, each pipeline on its own
    schedule, to hold the closed form (`predict`) against."""
    from planner.simulate import simulate  # (it imports this package's timing)

    sync, opt = sync_and_optimizer(plan, layers, costs)
    return simulate(stage_timings(plan, layers, costs),
                    [p.num_microbatches for p in plan.pipelines],
                    schedule=[p.schedule for p in plan.pipelines],
                    interleave=[p.interleave for p in plan.pipelines], sync=sync, optimizer=opt,
                    policy=plan.training.sync, loading=loading_time(plan, costs),
                    tail=tail_sync(plan, layers, costs), contention=plan_contention(plan, costs))


def plan_contention(plan: Plan, costs: CostModel) -> Contention:
    """How an overlapped sync and backward slow each other on `plan`'s devices
    (`step.worst` of what was measured of each)."""
    return worst(device_contention(costs.cluster.node(s.devices.node).device)
                 for p in plan.pipelines for s in p.stages)


def loading_time(plan: Plan, costs: CostModel) -> float:
    """The seconds `plan`'s step takes to load its input on the cost model's cluster
    (`planner.data.loading`; 0 where it sets no rates)."""
    return loading_seconds(input_rates(costs.cluster, plan.training), plan_feeds(plan))


def predict(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> CostBreakdown:
    """The step time of `plan` by cause, throughput and MFU."""
    timings = stage_timings(plan, layers, costs)
    times = pipeline_times(plan, timings)
    sync, opt = sync_and_optimizer(plan, layers, costs)
    slowest = max(times, key=lambda t: t.total)
    step = step_time([t.total for t in times], sync, opt,
                     overlappable(t.bwd for stages in timings for t in stages),
                     plan.training.sync, loading_time(plan, costs),
                     tail_sync(plan, layers, costs), plan_contention(plan, costs))
    batch = plan.training.global_batch
    flops = batch * sum(layer.flops for layer in layers)
    peak = sum(costs.cluster.node(s.devices.node).device.flops(plan.training.dtype) * s.tp
               for p in plan.pipelines for s in p.stages)
    seq = plan.training.seq_len
    return CostBreakdown(
        # pipelines waiting for their input (`step.fed`) idle as in a bubble
        # (an overlapped sync's contention slows the computing: `step.slowed`)
        step_time=step.total, compute=slowest.compute + step.slowed,
        bubble=slowest.bubble + (step.pipelines - slowest.total),
        tp_comm=slowest.tp_comm, pp_comm=slowest.pp_comm, dp_comm=step.exposed, optimizer=opt,
        samples_per_s=batch / step.total,
        tokens_per_s=batch * seq / step.total if seq else None,
        mfu=flops / step.total / peak if peak else 0.0, whole_sync=sync)

"""Where every rank sits in a plan: a pure function of the plan, the same on every
machine, so each process finds its place without talking to the others.

Rules:
  * one rank per device; a stage with `tp` devices is `tp` ranks;
  * nodes are numbered in plan cluster order, counting only nodes the plan uses
    (this is torchrun's `--node-rank`);
  * on a node, ranks follow the local device index (local rank i = the i-th
    used device, which `CUDA_VISIBLE_DEVICES` lists in that order);
  * global rank = ranks of the nodes before + local rank (what torchrun's static
    rendezvous assigns, even with a different --nproc-per-node per node).

Every pipeline must cover every layer once, in stage order; a device may hold
one stage only. Violations are PlannerErrors naming the pipeline and stage.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.types import Plan, StagePlan


@dataclass(frozen=True)
class NodeRanks:
    """The ranks of one plan node."""

    name: str
    node_rank: int
    devices: tuple[int, ...]  # local device indices the plan uses, ascending
    first_rank: int
    device_type: str
    host: str | None

    @property
    def nproc(self) -> int:
        return len(self.devices)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    @property
    def is_cpu(self) -> bool:
        return self.device_type.split("@")[0].lower() == "cpu"


@dataclass(frozen=True)
class RankSlot:
    """What one rank runs: stage `stage` of pipeline `pipeline`, tensor-parallel
    shard `tp_rank` (the stage's devices in ascending order), on device `device` of
    `node`."""

    rank: int
    node: str
    node_rank: int
    local_rank: int
    device: int
    pipeline: int
    stage: int
    tp_rank: int


@dataclass(frozen=True)
class Layout:
    nodes: tuple[NodeRanks, ...]
    slots: tuple[RankSlot, ...]  # by rank

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def of(self, rank: int) -> RankSlot:
        return self.slots[rank]

    def node(self, name: str) -> NodeRanks:
        return next(n for n in self.nodes if n.name == name)

    def stage_ranks(self, pipeline: int, stage: int) -> tuple[int, ...]:
        """The ranks of one stage, by tensor-parallel index."""
        found = sorted((s.tp_rank, s.rank) for s in self.slots
                       if s.pipeline == pipeline and s.stage == stage)
        return tuple(rank for _, rank in found)


def _check_coverage(plan: Plan) -> None:
    num_layers = _model_layers(plan)
    for p in plan.pipelines:
        if not p.stages:
            raise PlannerError("bad-plan", f"Pipeline {p.index} has no stages.",
                               ["regenerate the plan with `planner solve`"])
        if p.num_microbatches * p.micro_batch != p.batch_share:
            raise PlannerError(
                "bad-plan", f"Pipeline {p.index}: batch_share {p.batch_share} is not "
                f"num_microbatches {p.num_microbatches} x micro_batch {p.micro_batch}.",
                ["regenerate the plan with `planner solve`"])
        chunks = sorted((a, b, s.index) for s in p.stages for a, b in s.chunks)
        expected = 0
        for a, b, stage in chunks:
            if b <= a:
                raise PlannerError(
                    "bad-plan", f"Pipeline {p.index} stage {stage} has a chunk [{a}, {b}) "
                    "that holds no layers.", ["regenerate the plan with `planner solve`"])
            if a != expected:
                raise PlannerError(
                    "bad-plan", f"Pipeline {p.index} does not cover the model's layers "
                    f"0-{num_layers - 1} once each: a chunk starts at layer {a} where layer "
                    f"{expected} was expected.", ["regenerate the plan with `planner solve`"])
            expected = b
        if expected != num_layers:
            raise PlannerError("bad-plan", f"Pipeline {p.index} runs layers 0-{expected - 1}, "
                               f"where most pipelines run 0-{num_layers - 1}; every pipeline "
                               "runs the whole model.",
                               ["regenerate the plan with `planner solve`"])
        order = [s for _, _, s in chunks]
        pp = len(p.stages)
        if p.interleave == 1 and order != sorted(order):
            raise PlannerError("bad-plan", f"Pipeline {p.index}: stages are not in layer "
                               "order.", ["regenerate the plan with `planner solve`"])
        if p.interleave > 1 and order != [i % pp for i in range(pp * p.interleave)]:
            raise PlannerError(
                "bad-plan", f"Pipeline {p.index} interleaves {p.interleave} chunks per stage, "
                "but its chunks are not held round-robin (chunk j of stage s is the "
                "(j * stages + s)-th in layer order).",
                ["regenerate the plan with `planner estimate --interleave`"])
    if sum(p.batch_share for p in plan.pipelines) != plan.training.global_batch:
        raise PlannerError(
            "bad-plan", f"The pipelines' batch shares add up to "
            f"{sum(p.batch_share for p in plan.pipelines)}, not the global batch "
            f"{plan.training.global_batch}.", ["regenerate the plan with `planner solve`"])


def rank_layout(plan: Plan) -> Layout:
    """The rank of every (pipeline, stage, tp shard) of `plan` (see the module docstring)."""
    _check_coverage(plan)
    owner: dict[tuple[str, int], tuple[int, int, int]] = {}
    for p in plan.pipelines:
        for s in p.stages:
            _check_stage(plan, p.index, s)
            for t, device in enumerate(sorted(s.devices.devices)):
                key = (s.devices.node, device)
                if key in owner:
                    other = owner[key]
                    raise PlannerError(
                        "bad-plan", f"Device {device} of node {s.devices.node} is used by "
                        f"pipeline {other[0]} stage {other[1]} and by pipeline {p.index} stage "
                        f"{s.index}; the runtime runs one stage per device.",
                        ["regenerate the plan with `planner solve`"])
                owner[key] = (p.index, s.index, t)
    nodes: list[NodeRanks] = []
    slots: list[RankSlot] = []
    for spec in plan.cluster.nodes:
        devices = tuple(sorted(d for n, d in owner if n == spec.name))
        if not devices:
            continue
        first = len(slots)
        node = NodeRanks(name=spec.name, node_rank=len(nodes), devices=devices,
                         first_rank=first, device_type=spec.device.name, host=spec.host)
        nodes.append(node)
        for local, device in enumerate(devices):
            pipeline, stage, tp_rank = owner[spec.name, device]
            slots.append(RankSlot(rank=first + local, node=spec.name, node_rank=node.node_rank,
                                  local_rank=local, device=device, pipeline=pipeline,
                                  stage=stage, tp_rank=tp_rank))
    return Layout(nodes=tuple(nodes), slots=tuple(slots))


def _model_layers(plan: Plan) -> int:
    """How many layers the model has: where the pipelines end, most of them (the first
    such end on a tie), so that the error names a pipeline that differs."""
    ends = Counter(max(b for s in p.stages for _, b in s.chunks)
                   for p in plan.pipelines if p.stages and all(s.chunks for s in p.stages))
    return ends.most_common(1)[0][0] if ends else 0


def _check_stage(plan: Plan, pipeline: int, stage: StagePlan) -> None:
    where = f"Pipeline {pipeline} stage {stage.index}"
    try:
        node = plan.cluster.node(stage.devices.node)
    except PlannerError as exc:
        raise PlannerError("bad-plan", f"{where} runs on node {stage.devices.node!r}, which the "
                           f"plan's cluster does not have.", exc.remedies) from None
    if stage.device_type != node.device.name:
        raise PlannerError("bad-plan", f"{where} says it runs on {stage.device_type}, but node "
                           f"{node.name} has {node.device.name} devices.",
                           ["regenerate the plan with `planner solve`"])
    devices = stage.devices.devices
    if len(devices) != stage.tp or len(set(devices)) != len(devices):
        raise PlannerError("bad-plan", f"{where} has tp {stage.tp} but lists devices "
                           f"{list(devices)}; it needs {stage.tp} distinct devices.",
                           ["regenerate the plan with `planner solve`"])
    bad = [d for d in devices if not 0 <= d < node.devices]
    if bad:
        raise PlannerError("bad-plan", f"{where} uses device {bad[0]} of node {node.name}, "
                           f"which has devices 0-{node.devices - 1}.",
                           ["regenerate the plan with `planner solve`"])

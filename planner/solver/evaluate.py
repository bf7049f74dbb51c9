"""The objective: step time of a structure, given each class's split.

    step = max over pipelines p of T_p(m_p)  +  gradient sync  +  optimizer step

Micro-batches m_p >= 1 (sum: global batch / micro-batch size) go greedily to
the pipeline whose time grows least, which minimises the maximum for any
non-decreasing T_p (HAP's uneven shares); an interleaved pipeline runs a whole
multiple of its stages (`shares.grouped_shares`). Gradient sync: each stage's
gradients are all-reduced (ZeRO-1/2: reduce-scattered and gathered, the same
volume) among every pipeline that holds its first layer, on the nodes those
pipelines hold it on; a weight tied across stages (a head reading the
embedding's) is all-reduced on its own, after, among every stage holding either
layer (as the runtime sums it). The groups' all-reduces run at once: a node's
network card carries those of every stage it holds whose group spans nodes, one
after the other (`busiest_card`), so the sync lasts as long as the slowest stage's
or the busiest card's. ZeRO shards a stage over its class's pipelines, and only in
structures of one class (`zero_space`: as the runtime, which shards only layers
no other replica set holds), ZeRO-3 only where its pipelines run as many
micro-batches; ZeRO-3 stages reduce-scatter per micro-batch. Tied weights split
across stages, and all of them under ZeRO-3, stay whole in memory (`CostTable.zero_kept`).
The optimizer step updates each device's share of its stage's parameters, copies of
tied weights included (whole where ZeRO keeps them whole).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from cost_models.comm import Collective, CommGroup, busiest_card, send_sharing, shared_by
from planner.data.loading import Feed, loading_seconds
from planner.solver.interleave import fold
from planner.solver.keys import (
    CappedMemoKey,
    CardFloorKey,
    ClassResultKey,
    CrossClassFloorKey,
    GpipeFrontsMemoKey,
    HeaviestRunKey,
    ParameterPrefixKey,
    ShardedCardFloorsKey,
    StaircasesMemoKey,
)
from planner.solver.partition import (
    INF,
    ZERO_GATHER_REF,
    ClassResult,
    OutOfTime,
    Split,
    Staircase,
    check_time,
    class_costs,
    gpipe_front,
    least_zero3_busy,
    optimize,
    sharded_params,
)
from planner.solver.shares import grouped_shares, shares
from planner.solver.step import (
    EVERY_STEP,
    NO_CONTENTION,
    Contention,
    StepTime,
    floor,
    last_bucket,
    overlappable,
    pipelines_within,
    step_time,
    worst,
)
from planner.solver.structure import ClassShape, Placement, Slot, place
from planner.solver.table import CostTable
from planner.types import LinkSpec, Schedule, SyncSpec
from planner.types.training import Recompute


@dataclass(frozen=True)
class Config:
    """What every class of a structure shares: micro-batch size and model chunks per
    device (interleaved 1F1B if more than one; the search prices it on the folded
    table, `interleave.fold`), or GPipe's schedule; and the tensor-parallel degree of
    every class, or None where each class, and each block of the mixed class, has its
    own (`ClassShape.tps` either way)."""

    mb: int
    tp: int | None = None
    interleave: int = 1
    gpipe: bool = False

    @property
    def schedule(self) -> Schedule:
        if self.gpipe:
            return Schedule.GPIPE
        return Schedule.INTERLEAVED if self.interleave > 1 else Schedule.ONE_F_ONE_B


@dataclass(frozen=True)
class Space:
    """Choices the search may make besides structure (the user can narrow them)."""

    policies: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    zeros: tuple[int, ...] = (0, 1, 2, 3)


@dataclass(frozen=True)
class Evaluation:
    """A fully priced structure."""

    config: Config
    shapes: tuple[ClassShape, ...]
    placement: Placement
    splits: tuple[Split, ...]  # one per class
    microbatches: tuple[tuple[int, ...], ...]  # per class, per pipeline
    pipeline_times: tuple[tuple[float, ...], ...]
    sync: float
    optimizer: float
    policy: SyncSpec = EVERY_STEP  # the solve's (`CostTable.sync`)
    loading: float = 0.0  # the step's data loading (`step.fed`)
    tail: float = 0.0  # an overlapped sync's last bucket (`SyncTerms.tail`)
    contention: Contention = NO_CONTENTION  # its devices' (`step.worst`)

    @functools.cached_property
    def step(self) -> StepTime:
        """(Kept: the search reads the k-th best plan's step time at every node.)"""
        hidden = overlappable(stage.bwd for split in self.splits for stage in split.stages
                              ) if self.policy.overlap else 0.0
        return step_time([max(times) for times in self.pipeline_times], self.sync,
                         self.optimizer, hidden, self.policy, self.loading, self.tail,
                         self.contention)

    @property
    def step_time(self) -> float:
        return self.step.total


def hops(pipeline: Sequence[Slot], interleaved: bool) -> list[tuple[Slot, Slot]]:
    """The (sender, receiver) of each send of a pipeline: each stage to the next, and
    interleaved (S > 1) the last back to the first (the wrap-around)."""
    out = list(itertools.pairwise(pipeline))
    return [*out, (pipeline[-1], pipeline[0])] if interleaved and len(pipeline) > 1 else out


def placement_sharing(placement: Placement, interleaved: bool = False) -> dict[str, int]:
    """`send_sharing` of a whole structure: every send of every pipeline."""
    return send_sharing((a.node, b.node, min(a.tp, b.tp)) for slots in placement for p in slots
                        for a, b in hops(p, interleaved))


def class_links(table: CostTable, slots: Sequence[Sequence[Slot]],
                flows: dict[str, int] | None = None, interleaved: bool = False
                ) -> list[LinkSpec]:
    """The slowest link of each send (`hops`) over a class's pipelines, its bandwidth
    shared with the other sends its nodes' network cards carry (`flows`)."""
    every = [[_shared(table.link(a.node, b.node), shared_by(flows or {}, a.node, b.node))
              for a, b in hops(p, interleaved)] for p in slots]
    return [links[0].slowest(*links[1:]) for links in zip(*every, strict=True)]


def _shared(link: LinkSpec, ways: int) -> LinkSpec:
    return link if ways == 1 else dataclasses.replace(link, bandwidth=link.bandwidth / ways)


def zero_gathers(table: CostTable, slots: Sequence[Sequence[Slot]]
                 ) -> list[tuple[float, float]]:
    """Per stage, a ZeRO-3 all-gather among the class's pipelines (on their nodes) of
    1 byte and of ZERO_GATHER_REF bytes."""
    out = []
    for s in range(len(slots[0])):
        group = CommGroup.of([p[s].node for p in slots])
        out.append((table.collective(Collective.ALL_GATHER, 1.0, group),
                    table.collective(Collective.ALL_GATHER, ZERO_GATHER_REF, group)))
    return out


def class_result(table: CostTable, shape: ClassShape, config: Config, space: Space,
                 slots: Sequence[Sequence[Slot]], microbatches: int,
                 flows: dict[str, int] | None = None) -> ClassResult | None:
    """The class's best split (cached by everything its prices depend on); GPipe's
    pipelines hold all their micro-batches, at most their even share of these."""
    table = fold(table, config.interleave)
    links = tuple(class_links(table, slots, flows, config.interleave > 1))
    gathers = tuple(zero_gathers(table, slots))
    most = -(-microbatches // shape.n) if config.gpipe else None
    key = ClassResultKey(shape, config, space, links, gathers, most)
    if key not in table.cache:
        table.cache[key] = optimize(class_costs(
            table, shape.types, tps=shape.tps, mb=config.mb, n=shape.n, links=links,
            gathers=gathers, schedule=config.schedule, policies=space.policies,
            zeros=space.zeros, interleave=config.interleave, microbatches=most))
    return table.cache[key]


def group(config: Config, shape: ClassShape) -> int:
    """Micro-batches a class's pipelines run in whole multiples of: their stage count
    if interleaved (`shares.grouped_shares`), else 1."""
    return shape.stages if config.interleave > 1 else 1


def _holders(placement: Placement, splits: Sequence[Split], layer: int,
             groups: dict) -> CommGroup:
    """The nodes of every pipeline's stage that holds `layer` (`groups` remembers them
    for one placement, by which stage of each class that is)."""
    stages = tuple(bisect.bisect_right(split.bounds, layer) - 1 for split in splits)
    if stages not in groups:
        groups[stages] = CommGroup.of([p[stage].node for slots, stage in zip(
            placement, stages, strict=True) for p in slots])
    return groups[stages]


def _split_ties(table: CostTable, placement: Placement, splits: Sequence[Split],
                groups: dict) -> list[tuple[int, tuple[int, ...], float, CommGroup]]:
    """(owner, readers, parameters, holders) of each tied weight some pipeline holds on
    several stages: the runtime sums its gradient over every stage holding the owner or
    a reader, in an all-reduce of its own (its holders differ from the owner's other
    parameters'); `groups` as for `_holders`."""
    out = []
    for (owner, weights), tied in table.tie_readers.items():
        stages = tuple(tuple(dict.fromkeys(bisect.bisect_right(split.bounds, layer) - 1
                                           for layer in (owner, *tied))) for split in splits)
        if all(len(held) == 1 for held in stages):
            continue
        if ("tie", stages) not in groups:
            groups["tie", stages] = CommGroup.of([
                p[i].node for slots, held in zip(placement, stages, strict=True)
                for p in slots for i in held])
        out.append((owner, tuple(tied), weights, groups["tie", stages]))
    return out


def _prefix(table: CostTable) -> np.ndarray:
    """Prefix sums of the parameters per layer (cached)."""
    key = ParameterPrefixKey()
    if key not in table.cache:
        table.cache[key] = np.concatenate([[0.0], np.cumsum(table.params)])
    return table.cache[key]


@dataclass(frozen=True)
class SyncTerms:
    """What a structure's step pays after its pipelines (`step.StepTime`)."""

    sync: float  # one whole gradient sync
    optimizer: float
    tail: float = 0.0  # where the sync overlaps backward, the longest last-bucket all-reduce


def sync_and_optimizer(table: CostTable, config: Config, shapes: Sequence[ClassShape],
                       placement: Placement, splits: Sequence[Split],
                       groups: dict | None = None) -> SyncTerms:
    """Gradient sync and optimizer step (the slowest stage's). The sync groups'
    all-reduces start together: the sync lasts as long as the slowest stage's (its tied
    weights' after its own) or the busiest network card's (`busiest_card`), whichever is
    longer; where it overlaps backward, each stage's own all-reduce's last bucket
    (`step.last_bucket`, as `predict.tail_sync`). `groups` may carry sync groups, and
    their all-reduce times, between splits of one placement."""
    table = fold(table, config.interleave)
    groups = {} if groups is None else groups
    ties = _split_ties(table, placement, splits, groups)
    whole = _prefix(table)
    charges: list[tuple[str, tuple, CommGroup, float]] = []  # see `busiest_card`
    mine: list[tuple[tuple, CommGroup, float]] = []  # the stage's all-reduces

    def all_reduce(nbytes: float, group: CommGroup) -> float:
        key = ("all-reduce", id(group), nbytes)  # (`groups` keeps the group alive)
        if key not in groups:
            groups[key] = table.collective(Collective.ALL_REDUCE, nbytes, group)
        mine.append((key, group, groups[key]))
        return groups[key]

    sync = opt = tail = 0.0
    for shape, split, slots in zip(shapes, splits, placement, strict=True):
        for s in range(shape.stages):
            mine.clear()
            a, b = split.bounds[s], split.bounds[s + 1]
            params = float(whole[b] - whole[a])
            zero = split.options[s].zero
            holders = _holders(placement, splits, a, groups)
            tied = 0.0  # split ties: their own all-reduce, after the stage's
            for owner, readers, weights, group in ties:
                if any(a <= layer < b for layer in (owner, *readers)):
                    params -= weights if a <= owner < b else 0.0
                    tied += all_reduce(weights * table.grad_bytes, group)
            if zero < 3 or holders.size > shape.n:  # ZeRO-3: each shard across classes
                volume = params * table.grad_bytes / (shape.n if zero == 3 else 1)
                tied += all_reduce(volume, holders)
                if table.sync.overlap:
                    tail = max(tail, table.collective(
                        Collective.ALL_REDUCE, last_bucket(volume, table.sync.bucket_mb),
                        holders))
            sync = max(sync, tied)
            charges += [(node, *collective) for node in dict.fromkeys(p[s].node for p in slots)
                        for collective in mine]
            # the optimizer updates the stage's copies of tied weights too, whole where
            # ZeRO keeps them so (`CostTable.zero_kept`)
            kept = float(table.zero_kept(zero)[a, b])
            local = (float(table.range_params(shape.tps[s])[a, b]) - kept) / (
                shape.n if zero >= 1 else 1) + kept
            opt = max(opt, table.optimizer_time(shape.types[s], local))
    return SyncTerms(max(sync, busiest_card(charges)), opt, tail)


def evaluate(table: CostTable, config: Config, shapes: tuple[ClassShape, ...],
             placement: Placement, splits: Sequence[Split], microbatches: int,
             beat: float = float("inf"), groups: dict | None = None) -> Evaluation | None:
    """Price a structure whose classes use the given splits (None if its pipelines alone
    take `beat` or longer); `groups` as for `sync_and_optimizer`."""
    table = fold(table, config.interleave)
    counts = grouped_shares([(shape.n, split.bottleneck, split.total) for shape, split in zip(
        shapes, splits, strict=True)], [group(config, shape) for shape in shapes], microbatches)
    if counts is None:
        return None
    it = iter(counts)
    per_class = tuple(tuple(next(it) for _ in range(shape.n)) for shape in shapes)
    times = tuple(tuple(split.time(m) for m in ms) for split, ms in zip(splits, per_class,
                                                                        strict=True))
    if floor(max(map(max, times)), 0.0, 0.0) >= beat:  # (the sync and optimizer only add)
        return None
    terms = sync_and_optimizer(table, config, shapes, placement, splits, groups)
    feeds = (Feed(node=slots[0].node, device_type=shape.types[0], samples=m * config.mb)
             for shape, pipelines, ms in zip(shapes, placement, per_class, strict=True)
             for slots, m in zip(pipelines, ms, strict=True))  # (read only where rates are)
    return Evaluation(config=config, shapes=shapes, placement=placement, splits=tuple(splits),
                      microbatches=per_class, pipeline_times=times, sync=terms.sync,
                      optimizer=terms.optimizer, policy=table.sync,
                      loading=loading_seconds(table.inputs, feeds), tail=terms.tail,
                      contention=worst(table.type(name).contention for shape in shapes
                                       for name in shape.types) if table.sync.overlap
                      else NO_CONTENTION)


LINE_REF = 2.0**30  # bytes; an all-reduce among fixed ranks is affine in its bytes


@dataclass(frozen=True)
class Priced:
    """A structure with its classes' first splits (an achievable plan) and bounds."""

    config: Config
    shapes: tuple[ClassShape, ...]
    placement: Placement
    results: tuple[ClassResult, ...]
    upper: Evaluation
    lower: float  # no choice of splits makes this structure faster
    sync: float  # no choice of splits pays less for gradient sync
    optimizer: float  # ... for the optimizer step
    # with several classes, the groups each stage's all-reduce holds one of per other
    # class (`stage_groups`); per stage and layer range, its floor (`_split_sync_floor`)
    groups: tuple = ()
    floors: dict = field(default_factory=dict, compare=False, repr=False)

    def step_floor(self, pipelines: float, sync: float | None = None) -> float:
        """No plan of this structure whose pipelines take `pipelines` at least (and its
        sync `sync`, if given) is faster."""
        return floor(pipelines, self.sync if sync is None else max(self.sync, sync),
                     self.optimizer, self.upper.policy)


def zero_space(space: Space, shapes: Sequence[ClassShape], config: Config,
               microbatches: int) -> Space | None:
    """The choices a structure's classes have: ZeRO shards a stage only among replicas
    holding layers no other stage holds (the runtime keeps the rest out of FSDP), and
    with two classes every layer has two holders, so they run without ZeRO (with one,
    an interleaved stage shards each of its chunks). ZeRO-3 gathers the weights around
    every forward, a collective all replicas must join as often, so it needs the
    class's pipelines to run the same number of micro-batches (the runtime runs it as
    ZeRO-2 otherwise). A class whose blocks differ in degree runs without ZeRO too
    (`degree_space`). GPipe runs structures of one class only (its
    pipelines hold all their micro-batches, a count known before the shares only there).
    None if nothing is left of what the user allowed."""
    if config.gpipe and len(shapes) > 1:
        return None
    if len(shapes) > 1:
        space = dataclasses.replace(space, zeros=tuple(z for z in space.zeros if z == 0))
    elif 3 in space.zeros and microbatches % shapes[0].n:
        space = dataclasses.replace(space, zeros=tuple(z for z in space.zeros if z != 3))
    for shape in shapes:
        space = degree_space(space, shape.tps)
    return space if space.zeros else None


def degree_space(space: Space, tps: Sequence[int]) -> Space:
    """A class's choices given its stages' tensor-parallel degrees: without ZeRO where
    they differ (the followers of a wider stage, `runtime/follow.py`, run no sharded
    data parallel; the runtime keeps such stages whole)."""
    if len(set(tps)) == 1:
        return space
    return dataclasses.replace(space, zeros=tuple(z for z in space.zeros if z == 0))


def price(table: CostTable, config: Config, space: Space, shapes: tuple[ClassShape, ...],
          microbatches: int) -> Priced | None:
    """Price a structure with each class's smallest-bottleneck split, and bound it."""
    table = fold(table, config.interleave)
    placement = place(table, shapes)
    space = zero_space(space, shapes, config, microbatches)
    if placement is None or space is None:
        return None
    results = []
    flows = placement_sharing(placement, config.interleave > 1)
    for shape, slots in zip(shapes, placement, strict=True):
        result = class_result(table, shape, config, space, slots, microbatches, flows)
        if result is None:
            return None
        results.append(result)
    upper = evaluate(table, config, shapes, placement, [r.first for r in results],
                     microbatches)
    if upper is None:
        return None
    counts = shares([(shape.n, r.min_period, r.floor) for shape, r in zip(
        shapes, results, strict=True)], microbatches)
    sync, opt = _sync_and_optimizer_floor(table, config, space, shapes, placement)
    lower = floor(max(r.lower(m) for r, m in zip(
        [r for shape, r in zip(shapes, results, strict=True) for _ in range(shape.n)],
        counts, strict=True)), sync, opt, table.sync)
    return Priced(config=config, shapes=shapes, placement=placement, results=tuple(results),
                  upper=upper, lower=lower, sync=sync, optimizer=opt,
                  groups=stage_groups(table, shapes, placement))


def _sync_and_optimizer_floor(table: CostTable, config: Config, space: Space,
                              shapes: tuple[ClassShape, ...], placement: Placement
                              ) -> tuple[float, float]:
    """What any splits of this structure pay at least for gradient sync and for the
    optimizer: whichever stage holds the first (last) layer has at least its
    parameters, and the largest stage of each class at least its mean (on one of its
    types, all-reduced among at least the class's replicas of some stage, where ZeRO-3
    is not allowed, and with several classes with those of the others too:
    `cross_class_floor`);
    the first stages of all pipelines hold the first layer whatever the split, so they
    are its sync group."""
    sync = opt = 0.0
    untied = float(table.params.sum()) - sum(w for _, w in table.tied_weights)
    for shape, slots in zip(shapes, placement, strict=True):
        sharded = shape.n > 1 and any(z >= 1 for z in space.zeros)
        mean = float(table.rank_params(max(shape.tps)).sum()) / shape.stages / (
            shape.n if sharded else 1)
        opt = max(opt, min(table.optimizer_time(kind, mean) for kind in set(shape.types)))
        if shape.n > 1 and 3 not in space.zeros:
            sync = max(sync, min(table.collective(
                Collective.ALL_REDUCE, untied / shape.stages * table.grad_bytes,
                CommGroup.of([p[s].node for p in slots])) for s in range(shape.stages)))
    sync = max(sync, cross_class_floor(table, shapes, placement),
               card_floor(table, shapes, placement, 3 in space.zeros))
    for end, position in ((0, 0), (table.num_layers - 1, -1)):
        params = float(table.params[end])
        holders = [p[position].node for slots in placement for p in slots]
        for shape in shapes:
            zero3 = 3 in space.zeros and shape.n > 1
            sharded = shape.n > 1 and any(z >= 1 for z in space.zeros)
            if position == 0 and (not zero3 or len(holders) > shape.n):
                sync = max(sync, table.collective(  # ZeRO-3 shards it (see the module)
                    Collective.ALL_REDUCE, params * table.grad_bytes / (
                        shape.n if zero3 else 1), CommGroup.of(holders)))
            local = float(table.rank_params(shape.tps[position])[end]) / (
                shape.n if sharded else 1)
            opt = max(opt, table.optimizer_time(shape.types[position], local))
    return sync, opt


def card_floor(table: CostTable, shapes: tuple[ClassShape, ...], placement: Placement,
               zero3: bool) -> float:
    """What the busiest network card carries at least during the sync, whatever the
    splits (`busiest_card`). Where each stage of a class is all-reduced across nodes
    (a subset of its group spans several: its replicas in the class, or those with
    one of the partner groups of each other class, `stage_groups`), one pipeline's
    stages lie in runs, one per node it uses, whose all-reduces share that node's card
    and add up; the busiest run's all-reduces take at least its stages' intercepts (the
    fewest of any run) plus its layers' gradient bytes times its least slope of a
    stage (a tied weight's too: held apart from its readers, it is all-reduced on its
    own, through the cards of its owner's stage, among a group holding that stage's),
    and no cut of the layers into the runs, in their order, does better than
    `heaviest_run` (where a pipeline comes back to a node, than the parameters' bytes
    over the sum of the runs' bandwidths), each stage priced on the line of a subset of
    its group (no larger than it costs). Not where a stage may take ZeRO-3 (`zero3`:
    then it is not all-reduced within its class). Cached per structure."""
    if zero3:
        return 0.0
    key = CardFloorKey(shapes)
    if key in table.cache:
        return table.cache[key]
    out = 0.0
    crossed = stage_groups(table, shapes, placement)
    for c, (shape, slots) in enumerate(zip(shapes, placement, strict=True)):
        own = [CommGroup.of([p[s].node for p in slots]) for s in range(shape.stages)]
        for lines in _stage_lines(table, own, crossed[c] if crossed else ()):
            for runs in _node_runs(slots):
                out = max(out, _busiest_run(table, lines, runs))
    table.cache[key] = out
    return out


def _node_runs(slots: Sequence[Sequence[Slot]]) -> set[tuple[tuple[int, ...], ...]]:
    """Each distinct way a class's pipelines lie on nodes: per node a pipeline uses,
    in order, the stages it holds there."""
    return {tuple(tuple(s for s, slot in enumerate(p) if slot.node == node)
                  for node in dict.fromkeys(slot.node for slot in p)) for p in slots}


def _stage_lines(table: CostTable, own: list[CommGroup], crossed: tuple
                 ) -> list[list[tuple[float, float]]]:
    """Lines below each stage's all-reduce, one list for each subset of its group
    known to span several nodes (one inside a node is not charged to its card): its
    class's replicas (`own`), and beside each other class, those with one of their
    partner groups (`stage_groups`: the least intercept and slope of them)."""
    out = []
    if all(len(g.members) > 1 for g in own):
        out.append([all_reduce_line(table, g) for g in own])
    if crossed:
        where, options = crossed
        for d in range(len(options[0])):
            if any(len(g.members) < 2 for partners in options for g in partners[d]):
                continue
            per_set = []
            for partners in options:
                lines = [all_reduce_line(table, g) for g in partners[d]]
                per_set.append((min(a for a, _ in lines), min(b for _, b in lines)))
            out.append([per_set[i] for i in where])
    return out


def _busiest_run(table: CostTable, lines: list[tuple[float, float]],
                 runs: tuple[tuple[int, ...], ...]) -> float:
    """What one pipeline's busiest run of stages on a node carries at least
    (`card_floor`), given a line below each stage's all-reduce."""
    slopes = tuple(min(lines[s][1] for s in run) for run in runs)
    if min(slopes) <= 0:
        return 0.0
    least = min(sum(lines[s][0] for s in run) for run in runs)
    if sum(runs, ()) == tuple(range(len(lines))):
        return least + heaviest_run(table, slopes)
    return least + float(table.params.sum()) * table.grad_bytes / sum(1 / b for b in slopes)


def sharded_card_floors(table: CostTable, config: Config, shape: ClassShape,
                        slots: Sequence[Sequence[Slot]]) -> list[tuple[float, float]]:
    """`card_floor` of a structure of one class whose stages may take ZeRO-3, which
    do not all-reduce at the sync but gather their weights three times per
    micro-batch. Per threshold y of parameters, rising: what the busiest card carries
    at least if no stage on ZeRO-3 shards y or more, and the least busy time per
    micro-batch of a stage on ZeRO-3 that does (`partition.least_zero3_busy`;
    infinite where none can). A stage on ZeRO-3 under y takes at most y parameters'
    gradients off its run, and the tied weights it may hold with all their readers
    (then not all-reduced). The thresholds lie just above each size of layer (up to
    four), so that a stage past one holds a layer of the next size, then at 2, 3, 4,
    6, 8, ... times the largest, until nothing is left on the card. Cached per class
    and micro-batch size."""
    key = ShardedCardFloorsKey(shape, config.mb)
    if key in table.cache:
        return table.cache[key]
    out: list[tuple[float, float]] = []
    own = [CommGroup.of([p[s].node for p in slots]) for s in range(shape.stages)]
    if shape.n > 1 and all(len(g.members) > 1 for g in own):
        lines = [all_reduce_line(table, g) for g in own]
        cuts = [(heaviest_run(table, slopes), slopes, [len(run) for run in runs])
                for runs in _node_runs(slots)
                for slopes in [[min(lines[s][1] for s in run) for run in runs]]]
        widest = table.num_layers - shape.stages + 1  # layers one stage holds at most
        tied = sum(w for (owner, w), rs in table.tie_readers.items()
                   if max(owner, *rs) - min(owner, *rs) < widest) * table.grad_bytes
        stages = set(zip(shape.types, shape.tps, zero_gathers(table, slots), strict=True))
        sizes = np.unique(np.diagonal(sharded_params(table), offset=1))
        sizes = sizes[sizes > 0]
        sizes = sizes[np.unique(np.linspace(0, len(sizes) - 1, min(len(sizes), 4)).astype(int))]
        for held in _thresholds(sizes * (1 + 1e-9)):
            card = max(heaviest - max(b * (count * held * table.grad_bytes + tied)
                                      for b, count in zip(slopes, counts, strict=True))
                       for heaviest, slopes, counts in cuts)
            out.append((max(card, 0.0), min(
                least_zero3_busy(table, kind, tp=tp, mb=config.mb, gather=gather,
                                 held=held) for kind, tp, gather in stages)))
            if card <= 0:
                break
    table.cache[key] = out
    return out


def _thresholds(sizes: np.ndarray) -> Iterator[float]:
    """`sharded_card_floors`' thresholds: `sizes`, then 2, 3, 4, 6, 8, ... times the
    largest (the caller stops)."""
    yield from (float(size) for size in sizes)
    factor = 2
    while True:
        yield float(sizes[-1]) * factor
        factor = factor + 1 if factor < 4 else factor * 3 // 2


def heaviest_run(table: CostTable, slopes: Sequence[float]) -> float:
    """The least, over every cut of the layers into consecutive runs (as many as
    `slopes`, in their order, some maybe empty), of the largest run's slope times its
    layers' gradient bytes: a value no cut reaches below it, found by
    bisection on whether runs that cost at most T each can hold every layer (each run
    taking as many as fit, in order, covers the most). Cached per slopes."""
    key = HeaviestRunKey(tuple(slopes))
    if key not in table.cache:
        held = np.concatenate([[0.0], np.cumsum(table.params)]) * table.grad_bytes
        rates = np.asarray(slopes, dtype=float)

        def fits(most: float) -> bool:
            end = 0
            for rate in rates:
                end = int(np.searchsorted(held, held[end] + most / rate, side="right")) - 1
                if end == len(held) - 1:
                    return True
            return False

        low = held[-1] / float(np.sum(1 / rates))  # the water level: none reach it
        high = held[-1] * float(rates.max())
        if not fits(low):
            while high - low > 1e-9 * high:
                middle = (low + high) / 2
                low, high = (low, middle) if fits(middle) else (middle, high)
        table.cache[key] = low
    return table.cache[key]


def all_reduce_line(table: CostTable, group: CommGroup) -> tuple[float, float]:
    """(intercept, slope in bytes) of the all-reduce among `group`, no higher than it
    from 1 byte to `LINE_REF`."""
    ends = [table.collective(Collective.ALL_REDUCE, size, group) for size in (1.0, LINE_REF)]
    slope = max(0.0, (ends[1] - ends[0]) / (LINE_REF - 1))
    return max(0.0, ends[0] - slope), slope


def stage_groups(table: CostTable, shapes: tuple[ClassShape, ...], placement: Placement
                 ) -> tuple[tuple[tuple[int, ...], tuple[tuple[tuple[CommGroup, ...], ...],
                                                          ...]], ...]:
    """Per class c: per stage, which of the class's node sets it sits on, and per set,
    per other class d, the groups one of which its all-reduce holds. With several
    classes (no ZeRO: `zero_space`), the all-reduce of c's stage s is among the holders
    of its first layer: stage s of every pipeline of c and, for every other class d,
    some stage s_d of each of d's pipelines (one split per class: the same s_d for all
    of them), so its group holds stage s of c's pipelines with stage s_d of d's, for
    some s_d. A collective costs at least what it costs among a subset of its members.
    Empty for one class. (Not cached: the groups of every structure searched would add
    up to gigabytes on large clusters.)"""
    if len(shapes) < 2:
        return ()
    where, sets = [], []  # per class: per stage, its node set; the distinct sets' counts
    for shape, slots in zip(shapes, placement, strict=True):
        found: dict[tuple[str, ...], int] = {}
        where.append(tuple(found.setdefault(tuple(p[s].node for p in slots), len(found))
                           for s in range(shape.stages)))
        sets.append([dict(CommGroup.of(list(nodes)).members) for nodes in found])
    pairs: dict[tuple[int, int, int, int], CommGroup] = {}

    def union(c: int, i: int, d: int, j: int) -> CommGroup:
        if (c, i, d, j) not in pairs:
            counts = dict(sets[c][i])
            for node, n in sets[d][j].items():
                counts[node] = counts.get(node, 0) + n
            pairs[c, i, d, j] = pairs[d, j, c, i] = CommGroup(tuple(sorted(counts.items())))
        return pairs[c, i, d, j]

    return tuple((where[c], tuple(tuple(tuple(union(c, i, d, j) for j in range(len(sets[d])))
                                        for d in range(len(shapes)) if d != c)
                                  for i in range(len(sets[c]))))
                 for c in range(len(shapes)))


def cross_class_floor(table: CostTable, shapes: tuple[ClassShape, ...],
                      placement: Placement | None = None) -> float:
    """The sync a structure of several classes pays at least whatever its splits: the
    largest stage of each class holds at least 1/S of the untied parameters and is
    all-reduced among one of its `stage_groups` per other class (0: one class, or one
    that does not fit). Cached per structure."""
    key = CrossClassFloorKey(shapes)
    if key not in table.cache:
        placement = placement or place(table, shapes)
        groups = stage_groups(table, shapes, placement) if placement else ()
        untied = float(table.params.sum()) - sum(w for _, w in table.tied_weights)
        out = 0.0
        for c, shape in enumerate(shapes[:len(groups)]):
            least = INF  # (a node set's partners past `least` cannot lower it)
            for partners in groups[c][1]:
                least = min(least, _held(table, untied / shape.stages * table.grad_bytes,
                                         partners, least))
            out = max(out, least)
        table.cache[key] = out
    return table.cache[key]


def _held(table: CostTable, volume: float, partners: tuple[tuple[CommGroup, ...], ...],
          enough: float = INF) -> float:
    """The least an all-reduce of `volume` bytes costs whose group holds one group of
    each partner's (`stage_groups`), or some value from `enough` on if it is more."""
    out = 0.0
    for groups in partners:
        out = max(out, min(table.collective(Collective.ALL_REDUCE, volume, g) for g in groups))
        if out >= enough:
            break
    return out


def _split_sync_floor(table: CostTable, priced: Priced, index: int, split: Split) -> float:
    """What class `index`'s split pays at least for gradient sync beside the other
    classes, whatever their splits (0 for a structure of one class): each stage's
    parameters, less the tied weights it owns, all-reduced among one of its
    `stage_groups` per partner class."""
    if not priced.groups:
        return 0.0
    whole = _prefix(table)
    where, options = priced.groups[index]
    out = 0.0
    for s, (a, b) in enumerate(itertools.pairwise(split.bounds)):
        key = (index, where[s], a, b)
        if key not in priced.floors:
            owned = sum(w for owner, w in table.tied_weights if a <= owner < b)
            volume = max(0.0, float(whole[b] - whole[a]) - owned) * table.grad_bytes
            priced.floors[key] = _held(table, volume, options[where[s]])
        out = max(out, priced.floors[key])
    return out


def refine(table: CostTable, priced: Priced, microbatches: int,
           beat: float = float("inf"), gap: float = 0.0, deadline: float | None = None
           ) -> tuple[Evaluation | None, float]:
    """The structure's exact best: every combination of each class's splits that may
    beat the best so far (None if none is faster than `beat`): first of the steps of
    their staircases, then, against the best of those, with the splits that hold fewer
    parameters per stage too (`_useful_steps`), those only where they may beat it by
    more than `gap`; and the least step a split left out for the gap may have (inf if
    none was). Past `deadline` (a `time.perf_counter` value), the best found by then,
    and the structure's lower bound for what was left out."""
    table = fold(table, priced.config.interleave)
    best = priced.upper if priced.upper.step_time < beat else None
    groups: dict = {}
    tried: set[tuple] = set()
    skipped = INF
    sweeps = any(swept(priced.config, priced.shapes, c, microbatches)
                 for c in range(len(priced.shapes)))
    try:
        for capped in (False, True) if sweeps else (False,):
            bar = best.step_time if best else beat
            fronts: list[list[Split]] = [[] for _ in priced.results]
            # the classes whose splits are not swept first: none of theirs may beat the
            # bar, no combination does, and the sweeps are not needed
            for c in sorted(range(len(fronts)), key=lambda c: swept(
                    priced.config, priced.shapes, c, microbatches)):
                fronts[c], least = _useful_steps(table, priced, c, microbatches, bar,
                                                 gap if capped else None, deadline)
                skipped = min(skipped, least)
                if not fronts[c]:
                    break
            for combo in itertools.product(*fronts):
                if (key := tuple(split.bounds for split in combo)) in tried:
                    continue
                tried.add(key)
                check_time(deadline)
                bar = best.step_time if best else beat
                candidate = evaluate(table, priced.config, priced.shapes, priced.placement,
                                     combo, microbatches, bar, groups)
                if candidate is not None and candidate.step_time < bar:
                    best = candidate
    except OutOfTime:
        skipped = priced.lower
    return best, skipped


def _useful_steps(table: CostTable, priced: Priced, index: int, microbatches: int,
                  bar: float, gap: float | None = 0.0, deadline: float | None = None
                  ) -> tuple[list[Split], float]:
    """Class `index`'s splits that may beat `bar`: the steps of its staircase that may
    (`_stair_steps`), and (unless `gap` is None) the same of the splits that hold fewer
    parameters per stage that may beat it by more than `gap` (GPipe's: the splits of
    its front that may, `_gpipe_steps`); and the least step a split left out for the
    gap may have.

    Gradient sync and the optimizer step grow with a stage's parameters, so a split
    off the staircase, slower in its pipeline, may still make the faster step where
    those terms weigh: where its pipelines run no more micro-batches than they have
    stages (`swept`), the fill, much the same for every split, and not the period
    decides. There every split that no other beats in its largest stage, its total and
    its largest parameter count at once is a step of the staircase of the splits
    under some cap on that count (`_capped`). The caps fall below the most any step
    found so far holds, until no split under them may beat the bar (the fewer splits,
    the higher their least bottleneck and floor)."""
    result = priced.results[index]
    if result.costs.gpipe:  # (its front with few micro-batches is long: not per cap too)
        return _gpipe_steps(table, priced, index, result, microbatches, bar, deadline), INF
    if not swept(priced.config, priced.shapes, index, microbatches):
        gap = None
    params = [table.range_params(tp) for tp in priced.shapes[index].tps]
    found: dict[tuple[int, ...], Split] = {}
    under: ClassResult | None = result
    skipped = INF
    while under is not None:
        check_time(deadline)
        capped = under is not result
        useful, least = _stair_steps(table, priced, index, under, microbatches,
                                     bar * (1 - gap) if capped else bar)
        if least < bar:  # left out only for the gap
            skipped = min(skipped, least)
        if not useful:
            break
        for split in useful:
            if split.bounds not in found and _may_beat(table, priced, index, split,
                                                       microbatches, bar):
                found[split.bounds] = split
        if gap is None:
            break
        cap = max(float(held[a, b]) for split in useful
                  for held, (a, b) in zip(params, itertools.pairwise(split.bounds), strict=True))
        under = _capped(table, result, params, cap)
    return list(found.values()), skipped


def _may_beat(table: CostTable, priced: Priced, index: int, split: Split, microbatches: int,
              bar: float) -> bool:
    """Whether a plan in which class `index` takes this split may beat `bar`: its
    pipelines run on the split's period and fill, the other classes' at their bounds,
    and its stages pay at least their own sync beside the other classes
    (`_split_sync_floor`). A structure of one class: always."""
    if not priced.groups:
        return True
    lines = [(shape.n, r.min_period, r.floor) for shape, r in zip(
        priced.shapes, priced.results, strict=True)]
    lines[index] = (lines[index][0], split.bottleneck, split.total)
    return priced.step_floor(_fastest(lines, microbatches),
                             _split_sync_floor(table, priced, index, split)) < bar


def swept(config: Config, shapes: Sequence[ClassShape], index: int, microbatches: int
          ) -> bool:
    """Whether class `index`'s splits under parameter caps are searched: where its
    pipelines run at most as many micro-batches as they have stages, an even share (not
    GPipe's, whose front is long with few micro-batches)."""
    return not config.gpipe and -(-microbatches // sum(s.n for s in shapes)) <= shapes[
        index].stages


def _capped(table: CostTable, result: ClassResult, params: Sequence[np.ndarray], cap: float
            ) -> ClassResult | None:
    """The class's result over the splits whose every stage holds fewer than `cap`
    parameters per device (`params`: per stage, per layer range; None if none fits;
    kept as long as the result)."""
    memo = table.cache.setdefault(CappedMemoKey(), {})
    key = (id(result), cap)
    if key not in memo:
        costs = dataclasses.replace(result.costs, _hw={}, busy=[
            np.where(held >= cap * (1 - 1e-12), INF, b)
            for held, b in zip(params, result.costs.busy, strict=True)])
        bottleneck = costs.min_bottleneck()
        memo[key] = (result, None if not np.isfinite(bottleneck) else ClassResult(
            costs=costs, least_weights=costs.cost(INF), smallest_max=bottleneck,
            first=costs.split(costs.solve(bottleneck)[1]),
            # (fewer splits than the class's: its floor on the period holds, and none of
            # them has a stage below the smallest largest one)
            min_period=max(result.min_period, bottleneck)))
    return memo[key][1]


def _stair_steps(table: CostTable, priced: Priced, index: int, result: ClassResult,
                 microbatches: int, bar: float) -> tuple[list[Split], float]:
    """The steps of `result`'s staircase (class `index`'s, or its capped one's) up to
    the first from which on no split can beat `bar`: the steps after it have no
    smaller largest stage (nor a smaller total than the floor), and the other classes
    run at best at their own bounds. The class's own first step is always kept (the
    upper plan's). With them, the least step the splits left out may have (inf where
    the staircase ended)."""
    stair = _staircase(table, result)
    lines = [(shape.n, r.min_period, r.floor) for shape, r in zip(
        priced.shapes, priced.results, strict=True)]

    def least(largest_h: float) -> float:
        lines[index] = (lines[index][0], max(largest_h, result.min_period), result.floor)
        return priced.step_floor(_fastest(lines, microbatches))

    if result is not priced.results[index] and (first := least(result.smallest_max)) >= bar:
        return [], first
    count = 1
    while count < len(stair.points) or stair.extend():
        if (after := least(stair.points[count].largest_h)) >= bar:
            return stair.points[:count], after
        count += 1
    return stair.points[:count], INF


def _gpipe_steps(table: CostTable, priced: Priced, index: int, result: ClassResult,
                 microbatches: int, bar: float, deadline: float | None) -> list[Split]:
    """`_stair_steps` of a GPipe class (the one class of its structure): the splits of
    its staircase (`partition.gpipe_front`) whose period may still beat `bar`, as its
    busiest pipeline runs the most micro-batches of its shares at least at the
    class's least fill and the structure's least sync."""
    shape = priced.shapes[index]
    most = max(shares([(shape.n, result.min_period, result.floor)], microbatches) or [1])
    limit = (pipelines_within(bar, priced.sync, priced.optimizer, table.sync)
             - result.floor) / (most - 1) if most > 1 else INF
    memo = table.cache.setdefault(GpipeFrontsMemoKey(), {})
    known = memo.get(id(result))
    if known is None or known[1] < limit:  # (kept as long as the result: its id is valid)
        known = (result, limit, gpipe_front(result.costs, limit, deadline))
        memo[id(result)] = known
    return [split for split in known[2] if split.bottleneck < limit]


def _fastest(lines: Sequence[tuple[int, float, float]], microbatches: int) -> float:
    """The slowest pipeline's time under the best shares of `shares`' lines."""
    counts = shares(lines, microbatches)
    if counts is None:
        return float("inf")
    it = iter(counts)
    return max((next(it) - 1) * b + c for n, b, c in lines for _ in range(n))


def _staircase(table: CostTable, result: ClassResult) -> Staircase:
    """A class result's `Staircase`, kept as long as the result (in the table's cache)."""
    memo = table.cache.setdefault(StaircasesMemoKey(), {})
    if id(result) not in memo:
        memo[id(result)] = (result, Staircase(result))
    return memo[id(result)][1]

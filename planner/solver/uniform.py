"""Uniform TP x PP x DP plans, the way a heterogeneity-blind recipe lays them out.

Devices are taken node by node in cluster-file order and cut into tensor-
parallel groups of `tp` devices; `dp` pipelines take `pp` consecutive groups
each; layers are split Megatron's way (`megatron_bounds`: the blocks evenly, the
embedding with the first chunk and the head with the last; with v chunks per stage
for an interleaved schedule); every pipeline gets an even share of the global batch,
the micro-batches left over one each to the fastest pipelines (`even_shares`).
`estimate` prices a recipe the user fixes; the Megatron baseline is the best such
recipe.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from cost_models.model import CostModel
from planner.errors import PlannerError
from planner.solver.build import FIXED, assemble, stage_plan
from planner.solver.limits import check_global_batch
from planner.solver.table import check_tp_divides
from planner.types import (
    ClusterSpec,
    DeviceGroup,
    Layer,
    LayerKind,
    ModelSpec,
    PipelinePlan,
    Plan,
    Schedule,
    StagePlan,
    TrainingSpec,
)
from planner.types.training import Recompute


def groups(cluster: ClusterSpec, tp: int) -> list[tuple[str, int, str]]:
    """(node, slot, device type) of every tp group, in cluster-file order."""
    out = []
    for node in cluster.nodes:
        out.extend((node.name, i, node.device.name) for i in range(node.devices // tp))
    return out


def even_bounds(num_layers: int, parts: int) -> list[tuple[int, int]]:
    cuts = [round(i * num_layers / parts) for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def megatron_bounds(layers: Sequence[Layer], parts: int) -> list[tuple[int, int]]:
    """Megatron-LM's split: the blocks (and glue between them) cut into `parts` runs as
    even as they can be, the layers before the first (the embedding) going with the
    first run and those after the last (the head) with the last, where counting the
    embedding and the head as layers would give some stages an extra block. Where the
    blocks do not divide evenly, the end runs are among the shorter ones
    (`block_counts`). Fewer blocks than parts: every layer counts (`even_bounds`)."""
    inner = [i for i, layer in enumerate(layers)
             if layer.kind in (LayerKind.BLOCK, LayerKind.GLUE)]
    if len(inner) < parts:
        return even_bounds(len(layers), parts)
    cuts = list(itertools.accumulate(block_counts(inner[-1] + 1 - inner[0], parts),
                                     initial=inner[0]))
    cuts[0], cuts[-1] = 0, len(layers)
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def block_counts(blocks: int, parts: int) -> list[int]:
    """Blocks per run of `megatron_bounds`: counts that differ by one at most, the
    larger ones spread evenly over the middle runs, the first and last (which also hold
    the embedding and the head) larger only where the middle runs cannot take every
    extra block, the last before the first (1F1B keeps the fewest micro-batches in
    flight there). Rounding the even cuts had given both ends the extra block: GPT-3
    175B's 96 blocks in 64 stages put the embedding and 2 blocks on the first stage,
    30.4 GiB a device at tp 4 with full recompute, where 1 block beside it leaves no
    stage above 20.8 GiB, so the uniform baseline found no recipe for 24 GB L4s."""
    base, extra = divmod(blocks, parts)
    counts = [base] * parts
    middle = max(0, parts - 2)
    inside = min(extra, middle)
    for k in range(inside):
        counts[1 + k * middle // inside] += 1
    for end in (-1, 0)[:extra - inside]:
        counts[end] += 1
    return counts


def uniform_plan(*, layers: Sequence[Layer], model: ModelSpec, cluster: ClusterSpec,
                 training: TrainingSpec, costs: CostModel, tp: int, pp: int,
                 dp: int | None = None, micro_batch: int = 1,
                 recompute: Recompute = Recompute.NONE, zero: int = 0,
                 schedule: Schedule = Schedule.ONE_F_ONE_B, interleave: int = 1) -> Plan:
    """The uniform recipe as a Plan (its predictions included); errors name the option."""
    pipelines = uniform_pipelines(layers=layers, cluster=cluster, training=training,
                                  costs=costs, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch,
                                  recompute=recompute, zero=zero, schedule=schedule,
                                  interleave=interleave)
    return assemble(model=model, training=training, cluster=cluster, pipelines=pipelines,
                    layers=layers, costs=costs, solver=FIXED)


def uniform_pipelines(*, layers: Sequence[Layer], cluster: ClusterSpec,
                      training: TrainingSpec, costs: CostModel, tp: int, pp: int,
                      dp: int | None = None, micro_batch: int = 1,
                      recompute: Recompute = Recompute.NONE, zero: int = 0,
                      schedule: Schedule = Schedule.ONE_F_ONE_B, interleave: int = 1,
                      must_fit: bool = False) -> list[PipelinePlan] | None:
    """The uniform recipe's pipelines, stage memory included but not yet priced (None
    with `must_fit` if a device's memory overflows). Each step names the option at fault
    where the recipe cannot be laid out: the options alone (`_check_options`), the tp
    groups the cluster and the model allow (`_tp_groups`), the pipelines they hold
    (`_pipeline_count`), the layer chunks and micro-batches, which must feed every
    pipeline (`_check_feeds`); then the stages (`_recipe_pipelines`)."""
    check_global_batch(training.global_batch)
    _check_options(tp, pp, micro_batch, interleave, schedule)
    slots = _tp_groups(layers, cluster, tp, pp)
    given, most = bool(dp), len(slots) // pp  # (most: the pipelines the devices allow)
    dp = _pipeline_count(dp or most, cluster, slots, tp, pp)
    schedule = Schedule.INTERLEAVED if interleave > 1 else schedule
    chunks = megatron_bounds(layers, pp * interleave)
    if any(a == b for a, b in chunks):
        raise PlannerError("bad-option", f"{len(layers)} layers cannot be split into "
                           f"--pp {pp} x --interleave {interleave} non-empty chunks.",
                           ["lower --pp or --interleave"])
    batch = training.global_batch
    if batch % micro_batch:
        raise PlannerError("bad-option", f"--micro-batch {micro_batch} does not divide the "
                           f"global batch {batch}.", ["pick a divisor of the global batch"])
    _check_feeds(batch, micro_batch, dp, given, most, pp, interleave, zero,
                 f"{len(slots)} devices" if tp == 1 else f"{len(slots)} groups of --tp {tp}")
    return _recipe_pipelines(
        layers=layers, cluster=cluster, training=training, costs=costs,
        layout=[slots[p * pp:(p + 1) * pp] for p in range(dp)], chunks=chunks, tp=tp,
        micro_batch=micro_batch, recompute=recompute, zero=zero, schedule=schedule,
        interleave=interleave, must_fit=must_fit)


def _check_options(tp: int, pp: int, micro_batch: int, interleave: int,
                   schedule: Schedule) -> None:
    """The recipe's options on their own: positive, and a schedule they allow."""
    for name, value in (("--tp", tp), ("--pp", pp), ("--micro-batch", micro_batch),
                        ("--interleave", interleave)):
        if value < 1:
            raise PlannerError("bad-option", f"{name} must be at least 1 (got {value}).")
    if interleave > 1 and schedule is Schedule.GPIPE:
        raise PlannerError("bad-option", f"--interleave {interleave} runs interleaved 1F1B, "
                           "which contradicts --schedule gpipe.",
                           ["drop --schedule gpipe", "or drop --interleave"])
    if schedule is Schedule.GPIPE and pp == 1:
        raise PlannerError("bad-option", "--schedule gpipe needs pipelines of several stages, "
                           "which contradicts --pp 1.", ["use --pp 2 or more",
                                                         "or drop --schedule gpipe"])
    if interleave > 1 and pp == 1:
        raise PlannerError("bad-option", f"--interleave {interleave} needs a pipeline: with "
                           "--pp 1 there is no stage to interleave chunks with.",
                           ["use --pp 2 or more", "or drop --interleave"])


def _tp_groups(layers: Sequence[Layer], cluster: ClusterSpec, tp: int, pp: int
               ) -> list[tuple[str, int, str]]:
    """The cluster's tp groups (`groups`), where tp fits a node and divides the model's
    layers, and there are layers and groups for `pp` stages."""
    biggest = max(n.devices for n in cluster.nodes)
    fitting = [t for t in (1, 2, 4, 8, 16) if t <= biggest]
    if not any(n.devices % tp == 0 for n in cluster.nodes):
        dividing = [t for t in fitting if any(n.devices % t == 0 for n in cluster.nodes)]
        raise PlannerError(
            "bad-option", f"--tp {tp} does not fit any node of cluster {cluster.name}: its "
            f"nodes have {' or '.join(map(str, sorted({n.devices for n in cluster.nodes})))} "
            "devices, and tensor "
            "parallelism stays inside a node and splits it evenly.",
            [f"use one of --tp {', '.join(map(str, dividing))}"])
    check_tp_divides(layers, tp, fitting)
    if pp > len(layers):
        raise PlannerError("bad-option", f"--pp {pp} is more stages than the model has layers "
                           f"({len(layers)}).", [f"use --pp {len(layers)} or less"])
    slots = groups(cluster, tp)
    if pp > len(slots):
        raise PlannerError(
            "bad-option", f"--pp {pp} stages of --tp {tp} need {pp * tp} devices in groups of "
            f"{tp}; cluster {cluster.name} has {len(slots)} such groups "
            f"({cluster.num_devices} devices).", ["lower --pp" + (" or --tp" if tp > 1 else "")])
    return slots


def _pipeline_count(dp: int, cluster: ClusterSpec, slots: Sequence[tuple[str, int, str]],
                    tp: int, pp: int) -> int:
    """`dp`, where the groups hold that many pipelines of `pp` stages."""
    if dp < 1 or dp * pp > len(slots):
        raise PlannerError(
            "bad-option", f"--tp {tp} x --pp {pp} x --dp {dp} needs {tp * pp * dp} devices in "
            f"groups of {tp}; cluster {cluster.name} has {len(slots)} such groups "
            f"({cluster.num_devices} devices).", ["lower --dp or --pp", "lower --tp"])
    return dp


def _check_feeds(batch: int, micro_batch: int, dp: int, given: bool, most: int, pp: int,
                 interleave: int, zero: int, units: str) -> None:
    """Whether the global batch in micro-batches feeds the `dp` pipelines (`_feeds`);
    if not, the rule it breaks and what would (`_feed_remedies`). given: whether --dp
    was; most: the pipelines the devices allow, in `units` (devices or groups)."""
    total = batch // micro_batch
    if _feeds(total, dp, pp, interleave, zero):
        return
    pipes = (f"--dp {dp} pipelines" if given else f"{dp} pipelines (--dp was not given, "
             f"and defaults to as many as the devices allow: {units}, {pp} per pipeline)")
    remedies = _feed_remedies(batch, micro_batch, dp, given, most, pp, interleave, zero)
    if total < dp:
        raise PlannerError("bad-option", f"{total} micro-batch{'es' * (total != 1)} (the "
                           f"global batch of {batch} in micro-batches of {micro_batch}) "
                           f"cannot feed {pipes}.", remedies)
    if zero == 3 and total % dp:
        raise PlannerError(
            "bad-option", f"--zero 3 needs every pipeline to run as many micro-batches "
            f"as the others (each forward gathers the weights from all replicas), but "
            f"{total} micro-batches over {pipes} leave some with one more.",
            [*(["use --zero 2"] if _feeds(total, dp, pp, interleave, 2) else []),
             *remedies])
    raise PlannerError("bad-option", "An interleaved schedule needs each pipeline's "
                       f"micro-batch count to be a multiple of --pp {pp}, which {total} "
                       f"micro-batches over {pipes} cannot be.", remedies)


def _recipe_pipelines(*, layers: Sequence[Layer], cluster: ClusterSpec,
                      training: TrainingSpec, costs: CostModel,
                      layout: Sequence[Sequence[tuple[str, int, str]]],
                      chunks: Sequence[tuple[int, int]], tp: int, micro_batch: int,
                      recompute: Recompute, zero: int, schedule: Schedule, interleave: int,
                      must_fit: bool) -> list[PipelinePlan] | None:
    """The pipelines of `layout` (each its stages' tp groups), the layers in `chunks`
    (stage s holds chunks s, s + pp, ...), the micro-batches shared evenly
    (`even_shares`); None with `must_fit` where a stage overflows its device."""
    pipelines = []
    dp, pp = len(layout), len(layout[0])
    total = training.global_batch // micro_batch
    alike: dict[tuple, StagePlan] = {}  # stages differ only in their devices
    # the runtime shards a stage with ZeRO among its replicas of one device type, and
    # only layers no other replica set holds: stage positions on mixed types get none
    mixed = {s for s in range(pp) if len({layout[p][s][2] for p in range(dp)}) > 1}
    for p, m in enumerate(even_shares(total, layout, cluster, training.dtype)):
        stages = []
        for s in range(pp):
            node, slot, kind = layout[p][s]
            key = (s, m, id(cluster.node(node).device))
            if key not in alike:
                held = tuple(chunks[j * pp + s] for j in range(interleave))
                alike[key] = stage_plan(
                    index=s, layers=layers, bounds=(held[0][0], held[-1][1]), chunks=held,
                    node=node, first=slot * tp, device_type=kind, tp=tp, recompute=recompute,
                    zero=0 if s in mixed else zero, replicas=dp, micro_batch=micro_batch,
                    microbatches=m,
                    stages=pp, schedule=schedule, interleave=interleave, training=training,
                    cluster=cluster, costs=costs)
                if must_fit and alike[key].memory.total > cluster.node(node).device.memory:
                    return None
            stages.append(_moved(alike[key], DeviceGroup(
                node=node, devices=tuple(range(slot * tp, (slot + 1) * tp)))))
        pipelines.append(PipelinePlan(index=p, stages=tuple(stages),
                                      batch_share=m * micro_batch, micro_batch=micro_batch,
                                      num_microbatches=m, schedule=schedule,
                                      interleave=interleave))
    return pipelines


def _moved(stage: StagePlan, devices: DeviceGroup) -> StagePlan:
    """The stage on other devices (`dataclasses.replace`, without its cost)."""
    return StagePlan(index=stage.index, layers=stage.layers, chunks=stage.chunks,
                     modules=stage.modules, device_type=stage.device_type, devices=devices,
                     tp=stage.tp, recompute=stage.recompute, zero=stage.zero,
                     memory=stage.memory)


def even_shares(total: int, layout: Sequence[Sequence[tuple[str, int, str]]],
                cluster: ClusterSpec, dtype: str) -> list[int]:
    """Micro-batches per pipeline of `layout` (each pipeline's `groups` slots): `total`
    shared evenly, the ones left over one each to the fastest pipelines, those whose
    slowest device has the most peak FLOP/s (with layers split evenly it paces every
    micro-batch), then by their stages' device type names. Both are the same in any
    order of the cluster file's nodes, so reordering the file does not hand the extra
    micro-batches to other devices (pipelines alike in both keep their own order)."""
    def pace(p: int) -> tuple[float, tuple[str, ...]]:
        slowest = min(cluster.node(node).device.flops(dtype) for node, _, _ in layout[p])
        return -slowest, tuple(kind for _, _, kind in layout[p])

    base, left_over = divmod(total, len(layout))
    faster = set(sorted(range(len(layout)), key=pace)[:left_over])
    return [base + (p in faster) for p in range(len(layout))]


def _feeds(total: int, dp: int, pp: int, interleave: int, zero: int) -> bool:
    """Whether `total` micro-batches shared evenly can feed `dp` pipelines: one each at
    least, as many each for ZeRO-3, and a whole multiple of the `pp` stages each for an
    interleaved schedule (even shares that differ by one cannot both be)."""
    return (total >= dp and (zero != 3 or total % dp == 0)
            and (interleave == 1 or total % (dp * pp) == 0))


def _feed_remedies(batch: int, micro_batch: int, dp: int, given: bool, most: int, pp: int,
                   interleave: int, zero: int) -> list[str]:
    """What feeds the pipelines: a --dp that works with this batch, a smaller --micro-batch
    that works with this --dp, the least global batch above this one that does."""
    out = []
    dps = [n for n in range(most, 0, -1)
           if _feeds(batch // micro_batch, n, pp, interleave, zero)]
    if dps:
        out.append(f"use {'one of ' if len(dps) > 1 else ''}--dp "
                   f"{', '.join(map(str, dps[:3]))}" + (", ..." if len(dps) > 3 else "")
                   + ("" if given else " (fewer pipelines than the devices allow)"))
    smaller = [m for m in range(micro_batch - 1, 0, -1)
               if batch % m == 0 and _feeds(batch // m, dp, pp, interleave, zero)]
    if smaller:
        out.append(f"use --micro-batch {smaller[0]}")
    leasts = []
    for n in (dp, 1) if not dps and dp > 1 else (dp,):  # (--dp 1 too where none works)
        unit = micro_batch * (n * pp if interleave > 1 else n if zero == 3 else 1)
        least = max(n * micro_batch, -(-(batch + 1) // unit) * unit)
        if least in leasts:
            continue
        leasts.append(least)
        out.append(f"use a global batch of {least}" + (f" (or a larger multiple of {unit})"
                                                       if unit > 1 else " or more")
                   + (f" for {n} pipelines" if n == dp else " with --dp 1"))
    return out


def overflows(pipelines: Sequence[PipelinePlan], cluster: ClusterSpec) -> list[str]:
    """Devices whose predicted memory exceeds their capacity, as readable lines."""
    lines = []
    for p in pipelines:
        for s in p.stages:
            capacity = cluster.node(s.devices.node).device.memory
            if s.memory.total > capacity:
                term = s.memory.largest()
                lines.append(f"pipeline {p.index} stage {s.index} on {s.devices.node} "
                             f"({s.device_type}) needs {s.memory.total / 2**30:.1f} GiB of "
                             f"{capacity / 2**30:.1f} GiB; largest term: {term} "
                             f"{s.memory.terms()[term] / 2**30:.1f} GiB")
    return lines


def _largest_reducible(stage: StagePlan) -> str:
    """The stage's largest memory term other than the framework's fixed reserve."""
    terms = stage.memory.terms()
    del terms["reserve"]
    return max(terms, key=terms.__getitem__)


_SHARDED_BY = {"optimizer": 1, "gradients": 2, "weights": 3}  # the ZeRO stage that shards it


def memory_remedies(pipelines: Sequence[PipelinePlan], cluster: ClusterSpec) -> list[str]:
    """What would shrink the overflowing terms of this recipe, most direct first: only
    options it does not use already (no --recompute full if it has it, no ZeRO with one
    pipeline to shard over)."""
    first = pipelines[0]
    stage = first.stages[0]
    dp, pp, tp = len(pipelines), len(first.stages), stage.tp
    over = [s for p in pipelines for s in p.stages
            if s.memory.total > cluster.node(s.devices.node).device.memory]
    terms = {_largest_reducible(s) for s in over}
    mixed = {s.index for s in over if len({p.stages[s.index].device_type
                                           for p in pipelines}) > 1}
    out = []
    states = sorted((t for t in terms if t in _SHARDED_BY), key=_SHARDED_BY.__getitem__)
    if states:
        needed = max(_SHARDED_BY[t] for t in states)
        if dp > 1 and mixed:
            out.append(f"pipelines whose stage {min(mixed)} runs on one device type (ZeRO "
                       "shards only among replicas of one type, so it cannot shard the "
                       f"{' and '.join(states)} there)")
        elif dp > 1 and stage.zero < needed:
            out.append(f"--zero {needed} (shards the {' and '.join(states)} over the {dp} "
                       "pipelines)")
        elif dp == 1:
            out.append("more pipelines (--dp, on more devices): ZeRO shards over pipelines, "
                       "and this recipe has one")
    if "activations" in terms:
        if first.schedule is Schedule.GPIPE:
            out.append(f"--schedule 1f1b (GPipe keeps all {first.num_microbatches} "
                       "micro-batches' activations)")
        if stage.recompute is not Recompute.FULL:
            out.append("--recompute full" if stage.recompute is Recompute.SELECTIVE
                       else "--recompute selective (or full)")
        if first.micro_batch > 1:
            out.append(f"a smaller --micro-batch than {first.micro_batch}")
        if first.interleave > 1:
            out.append(f"fewer chunks than --interleave {first.interleave} (each keeps "
                       "more micro-batches in flight)")
    out.append(f"more pipeline stages than --pp {pp} (fewer layers per device)")
    biggest = max(n.devices for n in cluster.nodes)
    if tp < biggest:
        out.append(f"a larger --tp than {tp} (splits every layer's weights)")
    out.append("`planner solve`, which searches for a plan that fits")
    return out

"""Why no plan fits: the device and memory term that cannot fit, and what to try.

Three cases, checked in order:
  * the parameter states alone outgrow the whole cluster's memory;
  * the leanest plan there is (one pipeline over every device, full recompute,
    micro-batches of 1) overflows a device: more or bigger devices are needed;
  * that plan fits, so the constraints the user gave rule every plan out: each is
    named with how to relax it, and the leanest recipe that keeps them (as
    `planner estimate` would lay it out) names the device and term that overflow,
    or why it cannot be laid out.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.memory import GIB, framework_reserve, optimizer_state_bytes, sync_state_bytes
from cost_models.model import CostModel
from planner.dtypes import dtype_bytes
from planner.errors import Infeasible, PlannerError
from planner.solver.evaluate import Space
from planner.solver.limits import Limits, schedule_name
from planner.solver.uniform import even_bounds, overflows, uniform_pipelines
from planner.types import ClusterSpec, Layer, Schedule, TrainingSpec
from planner.types.training import Recompute

MORE_DEVICES = "add devices, or devices with more memory"


def _unexclude(excluded: Sequence[str]) -> list[str]:
    return ([f"use the nodes left out with --exclude ({', '.join(excluded)})"]
            if excluded else [])


def larger_than_cluster(layers: Sequence[Layer], cluster: ClusterSpec,
                        training: TrainingSpec, excluded: Sequence[str] = ()
                        ) -> Infeasible | None:
    """The error where the model's weights, gradients and optimizer states alone exceed
    the memory of every device of the cluster together (no plan can fit); else None."""
    weight = float(dtype_bytes(training.dtype))
    per_param = weight + (training.optimizer.grad_bytes or weight) + optimizer_state_bytes(
        training) + sync_state_bytes(training)
    params = sum(layer.params for layer in layers)
    room = sum(n.devices * (n.device.memory - framework_reserve(n.device))
               for n in cluster.nodes)
    if params * per_param <= room:
        return None
    holders = (f"the {cluster.num_devices} devices of cluster {cluster.name} have"
               if cluster.num_devices > 1 else f"the one device of cluster {cluster.name} has")
    return Infeasible(
        f"The model is larger than the whole cluster's memory: {params / 1e9:.3g}B "
        f"parameters need {params * per_param / GIB:,.0f} GiB for weights, gradients and "
        f"optimizer states ({per_param:g} bytes each), and {holders} "
        f"{room / GIB:,.0f} GiB after the framework reserve.",
        [MORE_DEVICES, *_unexclude(excluded),
         "train in a smaller dtype or with a lighter optimizer"], memory=True)


def diagnose(layers: Sequence[Layer], cluster: ClusterSpec, training: TrainingSpec,
             costs: CostModel, limits: Limits | None = None, space: Space | None = None,
             excluded: Sequence[str] = ()) -> Infeasible:
    limits, space = limits or Limits(), space or Space()
    unexclude = _unexclude(excluded)
    if (too_large := larger_than_cluster(layers, cluster, training, excluded)) is not None:
        return too_large
    devices = [n for n in cluster.nodes for _ in range(n.devices)]
    stages = min(len(layers), len(devices))
    worst = None
    for node, (a, b) in zip(devices, even_bounds(len(layers), stages), strict=False):
        memory = costs.memory(layers[a:b], node.device, training, recompute=Recompute.FULL,
                              micro_batch=1, in_flight=stages)
        over = memory.total / node.device.memory
        if worst is None or over > worst[0]:
            worst = (over, node, memory, b - a)
    over, node, memory, count = worst
    terms = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in memory.terms().items())
    leanest = (f"one pipeline over all {len(devices)} devices with full recompute and "
               f"micro-batches of 1 puts {count} layer(s) on one device of node {node.name} "
               f"({node.device.name}), needing {memory.total / GIB:.1f} GiB of its "
               f"{node.device.memory / GIB:.1f} GiB ({terms}; largest: {memory.largest()})")
    given = constraints(limits, space, stages)
    # an even spread that overflows the devices with the most memory rules out every
    # plan; one that overflows smaller devices only may not, where constraints were given
    largest = node.device.memory >= max(n.device.memory for n in cluster.nodes)
    if over > 1 and (largest or not given):
        return Infeasible(f"No plan fits in device memory. Even {leanest}.",
                          [MORE_DEVICES, *unexclude, "train with a shorter --seq-len"],
                          memory=True)
    flags = [flag for flag, _ in given]
    if over > 1:
        return Infeasible(
            f"No plan fits in device memory under the constraints given ({', '.join(flags)}), "
            f"and spreading the layers evenly does not help: {leanest}.",
            [*(remedy for _, remedy in given), MORE_DEVICES, *unexclude], constraints=flags,
            memory=True)
    if not given:
        return Infeasible(
            f"No plan fits in device memory, although {leanest}: plans that deep are "
            "outside the search space.",
            ["report this with the command that produced it", MORE_DEVICES], memory=True)
    overflow, layout = _leanest_kept(layers, cluster, training, costs, limits, space, stages)
    if overflow:
        message = (f"No plan fits in device memory under the constraints given "
                   f"({', '.join(flags)}). "
                   f"Without them, {leanest}. With them, the leanest recipe ({overflow}).")
    else:
        message = (f"No plan satisfies the constraints given ({', '.join(flags)})"
                   + (f": {layout.rstrip('.')}" if layout else "")
                   + f". Without them, {leanest}.")
    return Infeasible(message, [remedy for _, remedy in given], constraints=flags,
                      memory=bool(overflow))


def constraints(limits: Limits, space: Space, stages: int) -> list[tuple[str, str]]:
    """(flag as given, how to relax it) for every constraint that shrinks the search
    space; `stages`: how many the leanest pipeline needs."""
    out = []
    for flag, value in (("--tp", limits.tp), ("--pp", limits.pp), ("--dp", limits.dp)):
        if value is not None:
            out.append((f"{flag} {value}", f"drop {flag} {value}, or pick another value"))
    for flag, value in (("--max-tp", limits.max_tp), ("--max-dp", limits.max_dp)):
        if value is not None:
            out.append((f"{flag} {value}", f"raise {flag} {value}"))
    if limits.max_stages < stages and limits.pp is None:
        out.append((f"--max-stages {limits.max_stages}",
                    f"raise --max-stages {limits.max_stages} (one pipeline over every device "
                    f"has {stages} stages)"))
    if limits.interleave is not None and limits.interleave > 1:
        out.append((f"--interleave {limits.interleave}",
                    f"drop --interleave {limits.interleave} (interleaved 1F1B runs a whole "
                    "multiple of its stages in micro-batches on every pipeline), or pick "
                    "another value"))
    if limits.micro_batch is not None and limits.micro_batch > 1:
        out.append((f"--micro-batch {limits.micro_batch}",
                    f"use a smaller --micro-batch than {limits.micro_batch}"))
    if Recompute.FULL not in space.policies:
        given = "/".join(p.value for p in space.policies)
        out.append((f"--recompute {given}",
                    f"allow activation recompute: drop --recompute {given} (or pass full)"))
    if 3 not in space.zeros:
        given = "/".join(str(z) for z in space.zeros)
        out.append((f"--zero {given}", f"allow ZeRO sharding: drop --zero {given}"))
    for flag, value in (("--first-stage", limits.first_stage),
                        ("--last-stage", limits.last_stage)):
        if value is not None:
            out.append((f"{flag} {value}", f"drop {flag} {value}"))
    if limits.schedule is not None:
        name = schedule_name(limits.schedule)
        why = (" (GPipe holds all of a pipeline's micro-batches at once)"
               if limits.schedule is Schedule.GPIPE else "")
        out.append((f"--schedule {name}", f"drop --schedule {name}{why}"))
    if not limits.mixed:
        out.append(("--no-mixed", "drop --no-mixed (a pipeline may then span two device "
                                  "types)"))
    return out


def _leanest_kept(layers: Sequence[Layer], cluster: ClusterSpec, training: TrainingSpec,
                  costs: CostModel, limits: Limits, space: Space, stages: int
                  ) -> tuple[str | None, str | None]:
    """The leanest uniform recipe within the constraints (one pipeline unless --dp is
    fixed, the most stages allowed, the leanest recompute and ZeRO allowed): its first
    overflow (None if it fits), and why it cannot be laid out (None if it can)."""
    tp = limits.tp or 1
    pp = max(1, limits.pp or min(limits.max_stages, stages // tp))
    dp = limits.dp or 1
    policy = max(space.policies, key=list(Recompute).index)
    try:
        pipelines = uniform_pipelines(
            layers=layers, cluster=cluster, training=training, costs=costs, tp=tp, pp=pp,
            dp=dp, micro_batch=limits.micro_batch or 1, recompute=policy,
            zero=_leanest_zero(space, dp, training.global_batch // (limits.micro_batch or 1)))
    except PlannerError as exc:
        return None, exc.message
    problems = overflows(pipelines or [], cluster)
    if not problems:
        return None, None
    return f"tp {tp}, pp {pp}, dp {dp}, recompute {policy.value}: {problems[0]}", None


def _leanest_zero(space: Space, dp: int, microbatches: int) -> int:
    """The ZeRO stage that saves the most memory for dp pipelines (ZeRO-3 only where
    they run equal micro-batch counts, `evaluate.zero_space`)."""
    if dp == 1:
        return min(space.zeros)
    return max((z for z in space.zeros if z < 3 or microbatches % dp == 0),
               default=min(space.zeros))

"""What the same job costs without heterogeneity-aware planning, on the same cost model.

  data-parallel     every device holds the whole model, shares of the batch even
  uniform           the best Megatron-style TP x PP x DP recipe: even layer split,
                    even shares, devices by type, fastest first (what a planner that
                    assumes identical GPUs can do at best)
  fastest-type      the best plan using only the fastest device type

The recipes take the nodes fastest type first (`by_speed`) and hand the micro-batches
an even split leaves over to the fastest pipelines (`uniform.even_shares`), so no
baseline changes when the cluster file lists its nodes in another order.

Each takes the constraints given where its recipe has the knob (tp, pp and dp
degrees, micro-batch size, schedule, recompute and ZeRO, stage pins, --no-mixed;
--exclude through the cluster it is given), so the ratios compare plans the user
would accept; a baseline they rule out says which one does.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cost_models.model import CostModel
from planner.errors import Infeasible, PlannerError
from planner.solver.build import FIXED, assemble
from planner.solver.diagnose import constraints
from planner.solver.evaluate import Space
from planner.solver.limits import Limits
from planner.solver.uniform import uniform_pipelines
from planner.types import (
    Baseline,
    ClusterSpec,
    DeviceSpec,
    Layer,
    ModelSpec,
    PipelinePlan,
    Plan,
    Schedule,
    TrainingSpec,
)
from planner.types.training import Recompute

_MOST_STAGES = 64  # a uniform recipe's stages, unless --max-stages says fewer
_DEFAULT_STAGES = Limits().max_stages  # (the search's own cap, not a constraint given)


class _RuledOut(Exception):
    """A recipe the constraints given rule out (its layout breaks a stage pin or
    --no-mixed, or a stage of it cannot take the ZeRO stage allowed)."""


def _best(candidates: Sequence[Callable[[Recompute, int], list[PipelinePlan] | None]],
          savers: Sequence[tuple[Recompute, int]], common: dict) -> tuple[Plan | None, bool]:
    """The fastest plan over candidates, each with the cheapest memory saver that fits
    (only the pipelines that fit are priced); and whether any candidate could be laid
    out at all (else the options or the constraints given rule every one out)."""
    best, laid_out = None, False
    for make in candidates:
        for recompute, zero in savers:
            try:
                pipelines = make(recompute, zero)
            except (PlannerError, _RuledOut):
                break
            laid_out = True
            if pipelines is None:  # does not fit
                continue
            plan = assemble(pipelines=pipelines, solver=FIXED, **common)
            if best is None or plan.prediction.step_time < best.prediction.step_time:
                best = plan
            break
    return best, laid_out


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(8) if 2**i <= limit]


def memory_savers(space: Space) -> list[tuple[Recompute, int]]:
    """The (recompute, ZeRO) pairs `space` allows, cheapest first: ZeRO-1 and -2 cost no
    compute, so the leanest policy with each of them, then the others with the most
    sharding of them; then ZeRO-3 (with each policy if only ZeRO-3 is allowed)."""
    policies = [r for r in Recompute if r in space.policies]
    cheap = [z for z in (0, 1, 2) if z in space.zeros]
    out = [(policies[0], z) for z in cheap] + [(r, cheap[-1]) for r in policies[1:] if cheap]
    if 3 in space.zeros:
        out += [(policies[-1], 3)] if cheap else [(r, 3) for r in policies]
    return out


def _schedule(limits: Limits) -> tuple[Schedule, int]:
    """The schedule and chunk count a recipe runs under the constraints given."""
    if limits.interleave is not None and limits.interleave > 1:
        return Schedule.INTERLEAVED, limits.interleave
    if limits.schedule is Schedule.INTERLEAVED:
        return Schedule.INTERLEAVED, max(2, *limits.interleaves)
    return limits.schedule or Schedule.ONE_F_ONE_B, 1


def _data_parallel_conflict(limits: Limits, devices: int, types: set[str]) -> str | None:
    """The constraint given that rules out one replica per device (tp 1, pp 1), if any."""
    for flag, fixed, wanted in (("--tp", limits.tp, 1), ("--pp", limits.pp, 1),
                                ("--dp", limits.dp, devices)):
        if fixed is not None and fixed != wanted:
            return f"{flag} {fixed}"
    if limits.max_dp is not None and limits.max_dp < devices:
        return f"--max-dp {limits.max_dp}"
    schedule, interleave = _schedule(limits)
    if interleave > 1:
        return f"--interleave {interleave}" if limits.interleave else "--schedule interleaved"
    if schedule is Schedule.GPIPE:
        return "--schedule gpipe"
    for flag, pinned in (("--first-stage", limits.first_stage),
                         ("--last-stage", limits.last_stage)):
        if pinned is not None and types != {pinned}:
            return f"{flag} {pinned}"
    return None


def _obeys(pipelines: list[PipelinePlan] | None, limits: Limits, space: Space
           ) -> list[PipelinePlan] | None:
    """The pipelines; _RuledOut where one breaks a stage pin or --no-mixed, or a stage
    runs a ZeRO stage not allowed (a recipe shards none where a stage's replicas mix
    device types, `uniform.py`)."""
    for p in pipelines or []:
        kinds = [s.device_type for s in p.stages]
        if ((limits.first_stage is not None and kinds[0] != limits.first_stage)
                or (limits.last_stage is not None and kinds[-1] != limits.last_stage)
                or (not limits.mixed and len(set(kinds)) > 1)
                or any(s.zero not in space.zeros for s in p.stages)):
            raise _RuledOut
    return pipelines


def _given(limits: Limits, space: Space, num_layers: int) -> list[str]:
    """The constraints given, as flags (`diagnose.constraints`, with a --zero or
    --recompute that fixes one value though it does not shrink memory)."""
    flags = [flag for flag, _ in constraints(
        limits, space, 0 if limits.max_stages == _DEFAULT_STAGES else num_layers)]
    for flag, chosen in (("--recompute", [p.value for p in space.policies]),
                         ("--zero", [str(z) for z in space.zeros])):
        if len(chosen) == 1 and not any(f.startswith(flag) for f in flags):
            flags.append(f"{flag} {chosen[0]}")
    return flags


def _uniform(common: dict, limits: Limits, space: Space, tp: int, pp: int,
             micro_batch: int, recompute: Recompute, zero: int) -> list[PipelinePlan] | None:
    """A uniform recipe within the constraints given (as many pipelines as the devices
    allow, at most --max-dp, or --dp), None if it does not fit in memory."""
    schedule, interleave = _schedule(limits)
    recipe = dict(common, tp=tp, pp=pp, micro_batch=micro_batch, recompute=recompute,
                  zero=zero, schedule=schedule, interleave=interleave, must_fit=True)
    pipelines = uniform_pipelines(**recipe, dp=limits.dp)
    if pipelines and limits.max_dp is not None and len(pipelines) > limits.max_dp:
        pipelines = uniform_pipelines(**recipe, dp=limits.max_dp)
    return _obeys(pipelines, limits, space)


def baselines(*, layers: Sequence[Layer], model: ModelSpec, cluster: ClusterSpec,
              training: TrainingSpec, costs: CostModel,
              fastest_alone: Callable[[ClusterSpec], Plan | None],
              limits: Limits | None = None, space: Space | None = None
              ) -> tuple[Baseline, ...]:
    """The baselines (`baseline_plans` without their plans)."""
    return tuple(b.baseline for b in baseline_plans(
        layers=layers, model=model, cluster=cluster, training=training, costs=costs,
        fastest_alone=fastest_alone, limits=limits, space=space))


@dataclass(frozen=True)
class BaselinePlan:
    """A baseline and its plan (None where it has none)."""

    baseline: Baseline
    plan: Plan | None


def baseline_plans(*, layers: Sequence[Layer], model: ModelSpec, cluster: ClusterSpec,
                   training: TrainingSpec, costs: CostModel,
                   fastest_alone: Callable[[ClusterSpec], Plan | None],
                   limits: Limits | None = None, space: Space | None = None
                   ) -> tuple[BaselinePlan, ...]:
    """The baselines and their plans, within the constraints given (`limits`, `space`:
    each recipe takes the degrees, micro-batch size, schedule and memory savers they
    allow; a baseline they rule out says so). `fastest_alone` gives the best plan on the
    cluster of the fastest device type alone: None where the model does not fit those
    devices, or it raises the PlannerError the search on them ended with (the baseline
    then says what ruled them out: their memory, or the constraints given)."""
    limits, space = limits or Limits(), space or Space()
    cluster = by_speed(cluster, training.dtype)
    common = dict(layers=layers, cluster=cluster, training=training, costs=costs)
    whole = dict(common, model=model)
    savers = memory_savers(space)
    micro = [m for m in ((limits.micro_batch,) if limits.micro_batch else (1, 2, 4, 8))
             if training.global_batch % m == 0]
    out = []
    replicas = cluster.num_devices
    conflict = _data_parallel_conflict(limits, replicas, {n.device.name for n in cluster.nodes})
    dp_plan, laid_out = (None, False) if conflict else _best([
        (lambda r, z, mb=mb: _obeys(uniform_pipelines(
            **common, tp=1, pp=1, dp=replicas, micro_batch=mb, recompute=r, zero=z,
            must_fit=True), limits, space))
        for mb in micro], savers, whole)
    given = ", ".join(_given(limits, space, len(layers)))
    if conflict:
        why = f"the constraints given ({conflict}) rule out a replica on every device"
    elif training.global_batch < replicas:
        why = (f"a global batch of {training.global_batch} cannot feed {replicas} replicas "
               "(one per device)")
    elif not laid_out and given:
        why = f"the constraints given ({given}) rule out a replica on every device"
    else:
        why = "the model does not fit one device of every type"
    out.append(BaselinePlan(_baseline("data-parallel", "every device a replica, even batch "
                                      "shares", dp_plan, why), dp_plan))
    biggest = max(n.devices for n in cluster.nodes)
    tps = [limits.tp] if limits.tp else [t for t in _powers(biggest)
                                         if limits.max_tp is None or t <= limits.max_tp]
    stages = min(len(layers), _MOST_STAGES)
    if limits.max_stages != _DEFAULT_STAGES:
        stages = min(stages, limits.max_stages)
    pps = [limits.pp] if limits.pp else _powers(stages)
    uniform, laid_out = _best([
        (lambda r, z, tp=tp, pp=pp, mb=mb: _uniform(common, limits, space, tp, pp, mb, r, z))
        for tp, pp, mb in itertools.product(tps, pps, micro)], savers, whole)
    if not given:
        why = "no uniform recipe fits in memory"
    elif laid_out:
        why = f"no uniform recipe within the constraints given ({given}) fits in memory"
    else:
        why = f"the constraints given ({given}) rule out every uniform recipe"
    out.append(BaselinePlan(_baseline(
        "uniform", "best Megatron-style TP x PP x DP recipe: even layers, even shares, "
        "devices by type, fastest first", uniform, why), uniform))
    fastest = fastest_type(cluster, training.dtype)
    alone = dataclasses.replace(cluster, nodes=tuple(n for n in cluster.nodes
                                                     if n.device.name == fastest.name))
    reason = f"the model does not fit the {fastest.name} devices alone"
    try:
        plan = fastest_alone(alone)
    except PlannerError as exc:
        plan, reason = None, _ruled_out(exc, f"the {fastest.name} devices alone")
    description = f"the best plan on the {fastest.name} devices alone"
    if plan is not None and plan.solver.status != "optimal":  # stopped early
        description = (f"the best plan found before the search stopped on the {fastest.name} "
                       f"devices alone (within {plan.solver.gap:.1%} of their optimum)")
    out.append(BaselinePlan(_baseline("fastest-type", description, plan, reason), plan))
    return tuple(out)


def never_slower(plan: Plan, found: Sequence[BaselinePlan]) -> Plan:
    """The solve's plan with its baselines, or the fastest baseline's plan where one is
    faster: a recipe may lie outside the space the search covers (a uniform recipe of
    more stages than the search's --max-stages, or a chain its cut leaves out), and the
    plan returned is never slower than a baseline it prints. The report keeps the
    search's status and bound (no higher than the plan: the bound holds over the space
    searched and that baseline), and its search space says which baseline the plan is."""
    listed = tuple(b.baseline for b in found)
    step = plan.prediction.step_time
    faster = [b for b in found if b.plan is not None
              and b.plan.prediction.step_time < step * (1 - _SAME_STEP)]
    if not faster:
        return dataclasses.replace(plan, baselines=listed)
    best = min(faster, key=lambda b: b.plan.prediction.step_time)
    objective = best.plan.prediction.step_time
    bound = min(plan.solver.best_bound, objective)
    report = dataclasses.replace(
        plan.solver, objective=objective, best_bound=bound, gap=(objective - bound) / objective,
        search_space=f"{plan.solver.search_space}. The plan is the {best.baseline.name} "
                     f"baseline's, {step / objective:.2f}x as fast as the best plan the "
                     "search found")
    return dataclasses.replace(best.plan, solver=report, baselines=listed)


_SAME_STEP = 1e-9  # (steps this close are the same price: float noise)


def by_speed(cluster: ClusterSpec, dtype: str) -> ClusterSpec:
    """The cluster with its nodes fastest device type first (the most peak FLOP/s in
    `dtype`, then the most memory bandwidth, then the type's name), a type's nodes by
    name: the order a recipe takes devices in, the same whatever the order of the cluster
    file (`planner estimate` reproduces a recipe on a file that lists the nodes so)."""
    return dataclasses.replace(cluster, nodes=tuple(sorted(
        cluster.nodes, key=lambda n: (-n.device.flops(dtype), -n.device.memory_bandwidth,
                                      n.device.name, n.name))))


def fastest_type(cluster: ClusterSpec, dtype: str) -> DeviceSpec:
    """The device type the fastest-type baseline (and the search that seeds the solve)
    runs on alone: the first of `by_speed`, so ties go by name, not by file order."""
    return by_speed(cluster, dtype).nodes[0].device


def _ruled_out(error: PlannerError, where: str) -> str:
    """Why the search on `where` (the fastest device type alone) found no plan, from the
    error it ended with (`diagnose`'s says whether the constraints given or memory rule
    every plan out)."""
    if isinstance(error, Infeasible) and error.constraints:
        given = ", ".join(error.constraints)
        if error.memory:
            return f"under the constraints given ({given}), no plan on {where} fits in memory"
        return f"the constraints given ({given}) rule out a plan on {where}"
    if isinstance(error, Infeasible) and error.memory:
        return f"the model does not fit {where}"
    return f"no plan on {where}: {error.message}"


def _baseline(name: str, description: str, plan: Plan | None, reason: str) -> Baseline:
    if plan is None:
        return Baseline(name=name, description=description, prediction=None, reason=reason)
    shape = plan.pipelines[0]
    schedule = (", schedule gpipe" if shape.schedule is Schedule.GPIPE else
                f", interleave {shape.interleave}" if shape.interleave > 1 else "")
    detail = (f" (tp {shape.stages[0].tp}, pp {len(shape.stages)}, dp {len(plan.pipelines)}, "
              f"micro-batch {shape.micro_batch}{schedule}{_savers(plan)})")
    return Baseline(name=name, description=description + detail, prediction=plan.prediction)


def _savers(plan: Plan) -> str:
    """The recompute policy and ZeRO stage where every stage has the same (a recipe's
    memory savers, which `planner estimate` needs to reproduce it), else nothing."""
    kinds = {(stage.recompute, stage.zero) for p in plan.pipelines for stage in p.stages}
    if len(kinds) != 1:
        return ""
    recompute, zero = kinds.pop()
    return "".join([f", recompute {recompute.value}" if recompute is not Recompute.NONE
                    else "", f", ZeRO {zero}" if zero else ""])

"""What the same job costs without heterogeneity-aware planning, on the same cost model.

  data-parallel     every device holds the whole model, shares of the batch even
  uniform           the best Megatron-style TP x PP x DP recipe: even layer split,
                    even shares, devices in cluster-file order (what a planner that
                    assumes identical GPUs can do at best)
  fastest-type      the best plan using only the fastest device type
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from cost_models.model import CostModel
from planner.errors import Infeasible, PlannerError
from planner.solver.build import FIXED, assemble
from planner.solver.uniform import uniform_pipelines
from planner.types import (
    Baseline,
    ClusterSpec,
    Layer,
    ModelSpec,
    PipelinePlan,
    Plan,
    TrainingSpec,
)
from planner.types.training import Recompute

# memory savers in order of cost: the first that fits is the fastest
_SAVERS = [(Recompute.NONE, 0), (Recompute.NONE, 1), (Recompute.NONE, 2),
           (Recompute.SELECTIVE, 2), (Recompute.FULL, 2), (Recompute.FULL, 3)]


def _best(candidates: Sequence[Callable[[Recompute, int], list[PipelinePlan] | None]],
          common: dict) -> Plan | None:
    """The fastest plan over candidates, each with the cheapest memory saver that fits
    (only the pipelines that fit are priced)."""
    best = None
    for make in candidates:
        for recompute, zero in _SAVERS:
            try:
                pipelines = make(recompute, zero)
            except PlannerError:
                break
            if pipelines is None:  # does not fit
                continue
            plan = assemble(pipelines=pipelines, solver=FIXED, **common)
            if best is None or plan.prediction.step_time < best.prediction.step_time:
                best = plan
            break
    return best


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(8) if 2**i <= limit]


def baselines(*, layers: Sequence[Layer], model: ModelSpec, cluster: ClusterSpec,
              training: TrainingSpec, costs: CostModel,
              fastest_alone: Callable[[ClusterSpec], Plan | None]) -> tuple[Baseline, ...]:
    """The baselines; `fastest_alone` gives the best plan on the cluster of the fastest
    device type alone: None where the model does not fit those devices, or it raises the
    PlannerError the search on them ended with (the baseline then says what ruled them
    out: their memory, or the constraints given)."""
    common = dict(layers=layers, cluster=cluster, training=training, costs=costs)
    whole = dict(common, model=model)
    micro = [m for m in (1, 2, 4, 8) if training.global_batch % m == 0]
    out = []
    dp_plan = _best([
        (lambda r, z, mb=mb: uniform_pipelines(**common, tp=1, pp=1, dp=cluster.num_devices,
                                               micro_batch=mb, recompute=r, zero=z,
                                               must_fit=True))
        for mb in micro], whole)
    replicas = cluster.num_devices
    out.append(_baseline("data-parallel", "every device a replica, even batch shares", dp_plan,
                         f"a global batch of {training.global_batch} cannot feed {replicas} "
                         f"replicas (one per device)"
                         if training.global_batch < replicas else
                         "the model does not fit one device of every type"))
    biggest = max(n.devices for n in cluster.nodes)
    uniform = _best([
        (lambda r, z, tp=tp, pp=pp, mb=mb: uniform_pipelines(
            **common, tp=tp, pp=pp, micro_batch=mb, recompute=r, zero=z, must_fit=True))
        for tp, pp, mb in itertools.product(_powers(biggest), _powers(min(len(layers), 64)),
                                            micro)], whole)
    out.append(_baseline("uniform", "best Megatron-style TP x PP x DP recipe: even layers, "
                         "even shares, devices in file order", uniform,
                         "no uniform recipe fits in memory"))
    fastest = max(cluster.device_types().values(), key=lambda d: d.flops(training.dtype))
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
    out.append(_baseline("fastest-type", description, plan, reason))
    return tuple(out)


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
    detail = (f" (tp {shape.stages[0].tp}, pp {len(shape.stages)}, dp {len(plan.pipelines)}, "
              f"micro-batch {shape.micro_batch}{_savers(plan)})")
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

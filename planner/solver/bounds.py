"""A lower bound on the step time of any plan, from a linear program (MathOpt + HiGHS).

Let x[l, k] be the share of layer l's work done on device type k (fractional,
any split). With w[l, k] the fewest device-seconds per sample layer l needs on
type k (best tensor-parallel degree and micro-batch size), D_k devices of type
k, B the global batch:

    minimise T
    sum_k x[l, k] = 1                                   every layer is computed
    B * sum_l x[l, k] * w[l, k] <= T * D_k               type k's devices are busy at most T
    sum_l x[l, k] * p_l * s <= D_k * (M_k - R_k)          states fit, fully sharded, no copies

(p_l parameters, s bytes of weights, gradients and optimizer state per
parameter, M_k memory and R_k reserve per device). It ignores communication,
pipeline bubbles, activations and the optimizer step, so every real plan is
slower: `SolverReport.lower_bound` tells how far any plan could get.
"""

from __future__ import annotations

import numpy as np
from ortools.math_opt.python import mathopt

from planner.solver.table import CostTable


def lower_bound(table: CostTable, batch: int) -> float:
    model = mathopt.Model(name="step-time-lower-bound")
    t = model.add_variable(lb=0.0, name="T")
    work: dict[str, np.ndarray] = {}
    for info in table.types:
        best = np.full(table.num_layers, np.inf)
        for tp in table.tps:
            if not any(d % tp == 0 for d in info.node_devices):
                continue
            for mb in table.micro_batches:
                costs = table.costs(info.name, tp, mb)
                best = np.minimum(best, (costs.fwd + costs.bwd) * tp / mb)
        work[info.name] = best
    x = {(layer, info.name): model.add_variable(lb=0.0, ub=1.0, name=f"x_{layer}_{info.name}")
         for layer in range(table.num_layers) for info in table.types
         if np.isfinite(work[info.name][layer])}
    for layer in range(table.num_layers):
        model.add_linear_constraint(
            sum(x[layer, info.name] for info in table.types if (layer, info.name) in x) == 1)
    per_param = table.bytes_per_param(0, 1)
    for info in table.types:
        devices = sum(info.node_devices)
        terms = [(layer, v) for (layer, name), v in x.items() if name == info.name]
        model.add_linear_constraint(
            batch * sum(v * float(work[info.name][layer]) for layer, v in terms)
            <= devices * t)
        model.add_linear_constraint(
            sum(v * float(table.params[layer]) * per_param for layer, v in terms)
            <= devices * (info.memory - info.reserve))
    model.minimize(t)
    result = mathopt.solve(model, mathopt.SolverType.HIGHS)
    if result.termination.reason != mathopt.TerminationReason.OPTIMAL:
        return 0.0
    return float(result.objective_value())

"""Why no plan fits: the device and memory term that cannot fit, and what to try."""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.memory import GIB, optimizer_state_bytes
from cost_models.model import CostModel
from planner.dtypes import dtype_bytes
from planner.errors import PlannerError
from planner.solver.uniform import even_bounds
from planner.types import ClusterSpec, Layer, TrainingSpec
from planner.types.training import Recompute

REMEDIES = ["allow more pipeline stages (raise --max-stages, or drop --pp)",
            "enable activation recompute (drop --recompute none)",
            "allow ZeRO sharding (drop --zero 0)",
            "use a smaller --micro-batch",
            "add devices, or devices with more memory"]


def diagnose(layers: Sequence[Layer], cluster: ClusterSpec, training: TrainingSpec,
             costs: CostModel) -> PlannerError:
    weight = float(dtype_bytes(training.dtype))
    per_param = weight + (training.optimizer.grad_bytes or weight) + optimizer_state_bytes(
        training)
    params = sum(layer.params for layer in layers)
    room = sum(n.devices * (n.device.memory - (0.25 if n.device.is_cpu else 1.0) * GIB)
               for n in cluster.nodes)
    if params * per_param > room:
        return PlannerError(
            "infeasible",
            f"The model is larger than the whole cluster's memory: {params / 1e9:.3g}B "
            f"parameters need {params * per_param / GIB:,.0f} GiB for weights, gradients and "
            f"optimizer states ({per_param:g} bytes each), and the {cluster.num_devices} "
            f"devices of cluster {cluster.name} have {room / GIB:,.0f} GiB after the framework "
            "reserve.", [*REMEDIES[4:], "train in a smaller dtype or with a lighter optimizer"])
    devices = [(n, i) for n in cluster.nodes for i in range(n.devices)]
    stages = min(len(layers), len(devices))
    worst = None
    for (node, _), (a, b) in zip(devices, even_bounds(len(layers), stages), strict=False):
        memory = costs.memory(layers[a:b], node.device, training, recompute=Recompute.FULL,
                              micro_batch=1, in_flight=stages)
        over = memory.total / node.device.memory
        if worst is None or over > worst[0]:
            worst = (over, node, memory, b - a)
    _, node, memory, count = worst
    terms = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in memory.terms().items())
    return PlannerError(
        "infeasible",
        f"No plan fits in device memory. Even one pipeline over all {len(devices)} devices "
        f"with full recompute and micro-batches of 1 puts {count} layer(s) on a "
        f"{node.device.name} of node {node.name}, needing {memory.total / GIB:.1f} GiB of its "
        f"{node.device.memory / GIB:.1f} GiB ({terms}; largest: {memory.largest()}).",
        REMEDIES)

"""Measured per-layer memory (`LayerTiming.memory`) as feasibility uses it.

A profile from another tool (Metis, Sailor) records, per layer, the bytes one device of
a tp group held for it in a training step at micro-batch `mb`: its weights, gradients
and optimizer states, and that micro-batch's activations. What a plan changes is the
activations (ZeRO and the dtype change the states, which the cost model counts itself),
so a layer's measurements at each degree give its activations per sample:

    the slope of memory over micro-batch size (least squares), where a degree was
    measured at two or more sizes; else (memory - states) / mb, the states counted as
    `cost_models.memory.stage_memory` counts them for the layer alone (the measured
    dtype, Adam, no ZeRO).

They scale the traced activation figures of the layer (what it keeps without
recompute, with selective recompute, under full recompute, and the part every tp rank
keeps whole) by one factor, the least-squares fit of the measured per-sample bytes A_t
to the traced T_t over the degrees measured:

    scale = sum(A_t T_t) / sum(T_t^2)

so every recompute policy and degree keeps the trace's proportions at the measured
size. Activations are the model's and the framework's, not the GPU's: measurements on
any device of the cluster scale the layer wherever it runs (those of several devices
fitted together), in the search as in the memory it reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cost_models.memory import activation_bytes, stage_memory
from planner.types import ClusterSpec, DeviceSpec, Layer, LayerTiming, TrainingSpec
from planner.types.training import Recompute


def _per_sample(points: Sequence[LayerTiming], layer: Layer, device: DeviceSpec) -> float:
    """Activation bytes per sample from the memory measured at one degree (module
    docstring)."""
    sizes = {t.micro_batch for t in points}
    if len(sizes) > 1:
        xs = [float(t.micro_batch) for t in points]
        ys = [float(t.memory or 0.0) for t in points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        return max(0.0, sum((x - mean_x) * (y - mean_y)
                            for x, y in zip(xs, ys, strict=True)) / spread)
    point = points[0]
    states = stage_memory([layer], device=device, tp=point.tp,
                          training=TrainingSpec(global_batch=1, dtype=point.dtype))
    held = states.weights + states.gradients + states.optimizer
    return max(0.0, (float(point.memory or 0.0) - held) / point.micro_batch)


def activation_scale(layer: Layer, cluster: ClusterSpec) -> float | None:
    """The factor measured memory scales `layer`'s activation figures by (module
    docstring); None where no device measured its memory (or the trace keeps none)."""
    groups: dict[tuple[str, int, str], tuple[DeviceSpec, list[LayerTiming]]] = {}
    for node in cluster.nodes:
        measured = node.device.measured
        for t in measured.layer_times if measured else ():
            if t.memory is not None and t.layer == layer.signature:
                entry = groups.setdefault((node.device.name, t.tp, t.dtype), (node.device, []))
                if t not in entry[1]:
                    entry[1].append(t)
    fitted = [(_per_sample(points, layer, device),
               activation_bytes(layer, recompute=Recompute.NONE, tp=points[0].tp))
              for device, points in groups.values()]
    square = sum(traced * traced for _, traced in fitted)
    if not square:
        return None
    return max(0.0, sum(measured * traced for measured, traced in fitted) / square)


def scaled(layer: Layer, scale: float | None) -> Layer:
    """`layer` with its activation figures times `scale` (itself where None)."""
    if scale is None:
        return layer
    return dataclasses.replace(
        layer, activation_bytes=layer.activation_bytes * scale,
        selective_bytes=layer.selective_bytes * scale,
        replicated_bytes=layer.replicated_bytes * scale, input_bytes=layer.input_bytes * scale)

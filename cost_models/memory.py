"""Memory per device of one pipeline stage, by term, so a plan that does not fit can
say which term is too big.

For P parameters in the stage, on one device of a tensor-parallel group of
`tp` and a data-parallel group of `dp` (the ZeRO sharding group):

    weights     P/tp * dtype bytes                 (/dp under ZeRO-3)
    gradients   P/tp * gradient bytes              (/dp under ZeRO-2 and 3)
    optimizer   P/tp * optimizer state bytes       (/dp under ZeRO-1, 2 and 3)
                (tied weights the runtime keeps out of ZeRO's sharding stay whole:
                `planner.types.model.zero_kept`)
    activations per micro-batch * micro-batches in flight, by recompute policy:
                  none       the bytes each layer saves for backward
                  selective  all but what the attention core makes and saves
                             (a fused core's output and log-sum-exp)
                  full       only each layer's input, plus one layer's full
                             activations while its backward runs
                tensor parallelism shards them except the residual stream's
                (norms' inputs and outputs, the column-parallel projections'
                inputs, the layer input under full recompute), which every rank
                keeps whole without sequence parallelism (`Layer.replicated_bytes`);
                with it, all of them divide by tp (Korthikanti et al. 2022:
                34sbh/t per transformer layer instead of sbh(10 + 24/t))
    reserve     framework and allocator overhead: 1 GiB on GPUs (CUDA context,
                NCCL buffers, fragmentation), 0.25 GiB on CPUs

Adam in mixed precision keeps 12 bytes per parameter (fp32 master weights and
two moments), so weights + gradients + states = 2 + 2 + 12 = 16 bytes per
parameter without ZeRO: the rule of thumb of the ZeRO paper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from planner.dtypes import dtype_bytes
from planner.types import DeviceSpec, Layer, MemoryBreakdown, TrainingSpec
from planner.types.model import params_per_rank
from planner.types.training import Recompute

GIB = 2.0**30
Bytes = TypeVar("Bytes", float, np.ndarray)


def optimizer_state_bytes(training: TrainingSpec) -> float:
    """Bytes per parameter of optimizer state (Adam: moments, plus master weights
    when the training dtype is 16-bit)."""
    if training.optimizer.state_bytes is not None:
        return training.optimizer.state_bytes
    master = 4.0 if dtype_bytes(training.dtype) < 4 else 0.0
    return 8.0 + master


def sync_state_bytes(training: TrainingSpec) -> float:
    """Bytes per parameter the sync mode keeps beside the optimizer's state: DiLoCo's
    outer parameters and their Nesterov momentum, fp32 (`runtime/sync_modes.py`)."""
    return 8.0 if training.sync.mode == "diloco" else 0.0


def activation_bytes(layer: Layer, *, recompute: Recompute, tp: int) -> float:
    """Per-sample bytes a layer keeps between its forward and backward."""
    tp = layer.tp_share(tp)
    if recompute is Recompute.FULL:  # (sequence parallelism keeps its slice of the input)
        return layer.input_bytes / (tp if layer.sequence_parallel else 1)
    kept = layer.selective_bytes if recompute is Recompute.SELECTIVE else layer.activation_bytes
    whole = layer.replicated_bytes  # (every tp rank keeps the residual stream whole)
    return whole + (kept - whole) / tp


def stage_memory(layers: Sequence[Layer], *, device: DeviceSpec, training: TrainingSpec,
                 tp: int = 1, dp: int = 1, zero: int = 0, recompute: Recompute = Recompute.NONE,
                 micro_batch: int = 1, in_flight: int = 1, kept: float = 0.0
                 ) -> MemoryBreakdown:
    """Memory of one device that holds `layers` (a stage, or one virtual stage);
    `kept`: parameters of them that ZeRO leaves whole (`planner.types.model.zero_kept`),
    tied token tables, which a tp rank holds its share of where vocabulary parallelism
    splits the stage's embedding or head (as `params_per_rank` counts them)."""
    params = params_per_rank(layers, tp)
    if any(layer.vocab_layer and layer.tp_sharded for layer in layers):
        kept /= tp

    def held(per_param: float, level: int) -> float:
        """Bytes of a term that ZeRO stage `level` and above shard over dp."""
        return (params - kept) * per_param / (dp if zero >= level else 1) + kept * per_param

    weight = dtype_bytes(training.dtype)
    grad = training.optimizer.grad_bytes or weight
    per_sample = sum(activation_bytes(layer, recompute=recompute, tp=tp) for layer in layers)
    largest = max((activation_bytes(layer, recompute=Recompute.NONE, tp=tp)
                   for layer in layers), default=0.0)
    activations = kept_activations(per_sample, largest, recompute=recompute,
                                   micro_batch=micro_batch, in_flight=in_flight)
    return MemoryBreakdown(
        weights=held(weight, 3),
        gradients=held(grad, 2),
        optimizer=held(optimizer_state_bytes(training) + sync_state_bytes(training), 1),
        activations=activations,
        reserve=framework_reserve(device),
    )


def kept_activations(per_sample: Bytes, largest: Bytes, *, recompute: Recompute,
                     micro_batch: int, in_flight: int | float) -> Bytes:
    """Activation bytes a stage keeps at its peak: `per_sample` (its layers' per-sample
    bytes under `recompute`, `activation_bytes`) for each of the micro-batches in flight,
    and under full recompute, the largest layer's full activations (`largest`, per
    sample) again while its backward runs. The one rule for reports (`stage_memory`) and
    the search's exact splits (`planner.solver.partition`), which takes it on arrays of
    layer ranges."""
    held = per_sample * micro_batch * in_flight
    return held + largest * micro_batch if recompute is Recompute.FULL else held


def framework_reserve(device: DeviceSpec) -> float:
    """Bytes the framework keeps on a device whatever the plan: 1 GiB on GPUs (CUDA
    context, allocator), 0.25 GiB on CPU devices."""
    return 0.25 * GIB if device.is_cpu else GIB

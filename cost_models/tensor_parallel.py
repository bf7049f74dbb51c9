"""How a tensor-parallel group runs a layer under the plan's options (`TrainingSpec`):
vocabulary and sequence parallelism change a layer's per-layer figures, which the cost
model and the solver then price as they price any layer.

    vocabulary parallelism (`vocab_parallel`), on a transformer's embedding and LM
        head (`Layer.vocab_layer`): tensor parallelism splits the layer (its token
        table, the vocabulary-wide matmul and the loss over it: Megatron's
        vocabulary-parallel embedding and parallel cross-entropy), but for what stays
        whole (the final norm, the residual stream it reads). The embedding all-reduces
        its lookup in the forward pass, the head its input's gradient in the backward
        pass: one all-reduce of the hidden states per micro-batch each, priced as half
        in either pass (`tp_comm_bytes`). The cross-entropy's per-token statistics (a
        maximum, a sum and the target's logit: 12 bytes a token, 6/h of 16-bit hidden
        states of width h, 0.1% at h = 6,144) are left out.
    sequence parallelism (`sequence_parallel`), on layers it can split
        (`Layer.sequence_layer`) that tensor parallelism splits: nothing stays whole.
        Norms, dropout and residual adds run on a 1/tp slice of the sequence and keep
        what they save for backward there (Korthikanti et al. 2022: activations
        34sbh/t instead of sbh(10 + 24/t)), and every all-reduce becomes a
        reduce-scatter and an all-gather of the same bytes (`tp_comm_time`).

Neither changes a layer whose runtime module cannot run it: the embedding and head of
other models stay replicated, as the runtime runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cost_models.comm import Collective, CommGroup
from planner.types import Layer, LayerKind, TrainingSpec


def as_trained(layers: Sequence[Layer], training: TrainingSpec) -> tuple[Layer, ...]:
    """`layers` with their figures as `training`'s tensor-parallel options run them
    (the same layers when it sets none)."""
    return tuple(_trained(layer, training) for layer in layers)


def _trained(layer: Layer, training: TrainingSpec) -> Layer:
    if training.vocab_parallel and layer.vocab_layer and not layer.tp_sharded:
        hidden = layer.output_bytes if layer.kind is LayerKind.EMBEDDING else layer.input_bytes
        layer = dataclasses.replace(layer, tp_sharded=True, tp_comm_bytes=hidden / 2)
    if training.sequence_parallel and layer.sequence_layer and layer.tp_sharded:
        layer = dataclasses.replace(
            layer, sequence_parallel=True, replicated_bytes=0.0,
            kernels=tuple(dataclasses.replace(k, whole=False) for k in layer.kernels))
    return layer


def tp_comm_time(layer: Layer, micro_batch: int, group: CommGroup,
                 collective: Callable[[Collective, float, CommGroup], float]) -> float:
    """Seconds of `layer`'s tensor-parallel traffic in one pass (forward or backward) of
    a micro-batch over `group`: all-reduces of its `tp_comm_bytes`, or under sequence
    parallelism a reduce-scatter and an all-gather of them (in the ring model the same
    bytes and latency steps as the all-reduce they replace)."""
    nbytes = layer.tp_comm_bytes * micro_batch
    if layer.sequence_parallel:
        return (collective(Collective.REDUCE_SCATTER, nbytes, group)
                + collective(Collective.ALL_GATHER, nbytes, group))
    return collective(Collective.ALL_REDUCE, nbytes, group)

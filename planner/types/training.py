"""Training side of the data model: the global batch, sequence, dtype and optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Recompute(str, Enum):
    """Activation recomputation: none; selective, Megatron's (Korthikanti et al. 2022):
    recompute the attention core (QK^T, softmax, dropout, attention over V: a fused
    attention kernel) and keep everything else, which frees the core's output and
    statistics (a fused core never keeps the sequence-squared scores Megatron's unfused
    one recomputes; an unfused core is kept); or full (keep only each layer's input and
    run its forward again in backward, tensor-parallel collectives included). The order
    is by memory kept, most first."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Bytes per parameter the optimizer keeps.

    state_bytes: None = Adam's: two fp32 moments, plus an fp32 master copy of
                 the weights when training in bf16/fp16 (12 bytes), else 8.
    grad_bytes:  None = the training dtype's size.
    """

    name: str = "adam"
    state_bytes: float | None = None
    grad_bytes: float | None = None


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """What every stage trains with.

    sequence_parallel: Megatron's sequence parallelism (Korthikanti et al. 2022): a
        tensor-parallel group splits the residual stream of transformer blocks (norms,
        dropout, residual adds and what they save) over the sequence, and its
        all-reduces become reduce-scatters and all-gathers.
    vocab_parallel:    a tensor-parallel group splits a transformer's embedding and LM
        head over the vocabulary (vocabulary-parallel embedding, parallel
        cross-entropy), where otherwise every rank runs them whole.
    """

    global_batch: int
    seq_len: int | None = None
    dtype: str = "bf16"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    sequence_parallel: bool = False
    vocab_parallel: bool = False

"""Training side of the data model: the global batch, sequence, dtype and optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Recompute(str, Enum):
    """Activation recomputation: none, selective (Megatron: recompute the cheap,
    memory-heavy ops: attention core and elementwise), or full (keep only each
    layer's input and run its forward again in backward)."""

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
    global_batch: int
    seq_len: int | None = None
    dtype: str = "bf16"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)

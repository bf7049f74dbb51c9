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


SYNC_MODES = ("every-step", "local-sgd", "average", "diloco")


@dataclass(frozen=True, kw_only=True)
class SyncSpec:
    """How the pipelines holding the same parameters keep them equal.

    mode:     every-step: each step sums every parameter's gradient over its holders
              (what data parallelism does); the others change the optimization, so they
              are asked for: each pipeline steps on its own gradients (its loss the mean
              over its own share) and every `interval` steps the holders average
              (weighted by their pipelines' batch shares: work-weighted, so a pipeline
              that ran more samples counts more) their parameters (local-sgd: local SGD,
              each keeping its optimizer's state), their parameters and optimizer states
              (average: periodic model averaging of the whole state), or the change since
              the last sync, a pseudo-gradient that an outer optimizer (SGD with Nesterov
              momentum) applies to the parameters every pipeline keeps of that sync
              (diloco: DiLoCo, Douillard et al. 2023).
    interval: H, optimizer steps per sync (1 for every-step).
    overlap:  every-step only: each stage's gradient sums start, bucket by bucket, as
              its last micro-batch's backward makes them (DDP's buckets), not after the
              schedule.
    bucket_mb: with overlap, the most MiB of gradients one all-reduce sums (DDP's
              bucket_cap_mb): the runtime cuts the sums so, and the step pays the last
              bucket's all-reduce whatever backward hides (`step.last_bucket`).
    """

    mode: str = "every-step"
    interval: int = 1
    overlap: bool = False
    bucket_mb: float = 25.0

    @property
    def local(self) -> bool:
        """Whether pipelines step on their own gradients between syncs."""
        return self.mode != "every-step"

    def describe(self) -> str:
        """The mode as `--sync` takes it, with overlap where asked."""
        if self.local:
            return f"{self.mode}:{self.interval}"
        return "every-step, overlapping backward" if self.overlap else "every-step"


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
    sync:              how pipelines holding the same layers keep them equal (`SyncSpec`).
    """

    global_batch: int
    seq_len: int | None = None
    dtype: str = "bf16"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    sync: SyncSpec = field(default_factory=SyncSpec)
